"""Deployments across hosts: a worker that requires the shared secret and client certificates
(mutual TLS), a scheduler that reaches it with both and serves its public API over TLS, and the
clients (Python, CLI, health probe) that trust the test's own CA. Certificates are made here."""
import datetime
import ipaddress
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from nanoserve.client import Client
from nanoserve.healthcheck import serving_status
from nanoserve.tls import TLSFiles, open_channel
from nanoserve.v1 import worker_pb2, worker_pb2_grpc
from nanoserve.wire import TOKEN_KEY, TOKEN_SCHEME
from tests.services.processes import CLI, ENV, free_port, start_scheduler, start_worker, stop

TOKEN = "s3cret-token"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer: str, issuer_key, is_ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if not is_ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key) -> tuple[str, str]:
    cert_file, key_file = directory / f"{name}.pem", directory / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """A CA, and a server and a client certificate it signed (valid for localhost and 127.0.0.1)."""
    directory = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("nanoserve test CA", ca_key, "nanoserve test CA", ca_key, is_ca=True)
    files = {"ca": _write(directory, "ca", ca, ca_key)[0]}
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = _certificate(name, key, "nanoserve test CA", ca_key, is_ca=False)
        files[f"{name}_cert"], files[f"{name}_key"] = _write(directory, name, certificate, key)
    return files


def wait_serving_tls(address: str, tls: TLSFiles, procs: list, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), log.read_text()[-4000:]
        try:
            if serving_status(address, timeout=1, tls=tls) == "SERVING":
                return
        except grpc.RpcError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"not serving after {timeout}s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def secured(pki, tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("secured") / "services.log"
    worker = f"127.0.0.1:{free_port()}"
    address = f"127.0.0.1:{free_port()}"
    procs = [start_worker(Path(tiny_model_dir), int(worker.split(":")[1]), "--block-size", "16", "--num-kv-blocks",
                          "64", "--worker-token", TOKEN, "--tls-cert-file", pki["server_cert"], "--tls-key-file",
                          pki["server_key"], "--tls-ca-file", pki["ca"], log=log)]
    procs.append(start_scheduler([worker], int(address.split(":")[1]), "--worker-token", TOKEN,
                                 "--worker-tls-ca-file", pki["ca"], "--worker-tls-cert-file", pki["client_cert"],
                                 "--worker-tls-key-file", pki["client_key"], "--tls-cert-file", pki["server_cert"],
                                 "--tls-key-file", pki["server_key"], log=log))
    try:
        wait_serving_tls(address, TLSFiles(ca_file=pki["ca"]), procs, log)
        yield {"address": address, "worker": worker}
    finally:
        stop(procs)


def test_clients_that_trust_the_ca_are_served_over_tls(secured, pki):
    with Client(secured["address"], TLSFiles(ca_file=pki["ca"])) as client:
        done = client.generate([1, 2, 3], max_tokens=4, temperature=0, ignore_eos=True)
    assert len(done.token_ids) == 4
    info = subprocess.run(CLI + ["info", "--address", secured["address"], "--tls-ca-file", pki["ca"]], env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert info.returncode == 0 and '"num_kv_blocks": 64' in info.stdout, info.stderr
    probe = subprocess.run([sys.executable, "-m", "nanoserve.healthcheck", "--address", secured["address"],
                            "--tls-ca-file", pki["ca"]], env=ENV, capture_output=True, text=True, timeout=30)
    assert probe.returncode == 0, probe.stderr


def test_a_plaintext_client_is_not_served(secured):
    with Client(secured["address"]) as client, pytest.raises(grpc.RpcError) as info:
        client.model_info()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def worker_stub(secured, pki, with_client_cert: bool = True) -> tuple[grpc.Channel, worker_pb2_grpc.WorkerStub]:
    cert = (pki["client_cert"], pki["client_key"]) if with_client_cert else ("", "")
    channel = open_channel(secured["worker"], TLSFiles(*cert, ca_file=pki["ca"]))
    return channel, worker_pb2_grpc.WorkerStub(channel)


@pytest.mark.parametrize("metadata", [(), ((TOKEN_KEY, TOKEN_SCHEME + "guess"),)], ids=["no token", "wrong token"])
def test_the_worker_requires_its_token(secured, pki, metadata):
    channel, stub = worker_stub(secured, pki)
    with channel, pytest.raises(grpc.RpcError) as info:
        stub.Describe(worker_pb2.DescribeRequest(), metadata=metadata, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "--worker-token" in info.value.details()
    channel, stub = worker_stub(secured, pki)
    with channel:  # the same call with the secret is answered
        assert stub.Describe(worker_pb2.DescribeRequest(), metadata=((TOKEN_KEY, TOKEN_SCHEME + TOKEN),),
                             timeout=10).block_size == 16


def test_the_worker_requires_a_client_certificate(secured, pki):
    channel, stub = worker_stub(secured, pki, with_client_cert=False)
    with channel, pytest.raises(grpc.RpcError) as info:
        stub.Describe(worker_pb2.DescribeRequest(), metadata=((TOKEN_KEY, TOKEN_SCHEME + TOKEN),), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
