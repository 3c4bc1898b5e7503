"""TLS for nanoserve's gRPC endpoints with grpc's own credentials, from PEM files named by flags.

A server with a certificate and key serves TLS; with a CA file as well it requires client
certificates that chain to it (mutual TLS). A client with a CA file connects over TLS and checks
the server's certificate against it; with a certificate and key it presents them. No files: plaintext.
"""
from dataclasses import dataclass
from pathlib import Path

import grpc


class TLSConfigError(ValueError):
    """A TLS flag that cannot be used; the message names the flag and the file."""


@dataclass(frozen=True)
class TLSFiles:
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    flag_prefix: str = "--tls"  # how the flags are spelled, for messages: --tls-cert-file, --worker-tls-...

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.key_file or self.ca_file)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None for plaintext; TLS needs both a certificate and a key."""
        if not self.enabled:
            return None
        if not (self.cert_file and self.key_file):
            raise TLSConfigError(f"a TLS server needs both {self.flag_prefix}-cert-file and "
                                 f"{self.flag_prefix}-key-file")
        ca = self._read("ca") if self.ca_file else None
        return grpc.ssl_server_credentials([(self._read("key"), self._read("cert"))], root_certificates=ca,
                                           require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """None for plaintext; TLS when a CA file is given (a client certificate needs its key)."""
        if not self.enabled:
            return None
        if not self.ca_file:
            raise TLSConfigError(f"{self.flag_prefix}-cert-file / {self.flag_prefix}-key-file need "
                                 f"{self.flag_prefix}-ca-file (the CA the server's certificate chains to)")
        if bool(self.cert_file) != bool(self.key_file):
            raise TLSConfigError(f"a client certificate needs both {self.flag_prefix}-cert-file and "
                                 f"{self.flag_prefix}-key-file")
        key, cert = (self._read("key"), self._read("cert")) if self.cert_file else (None, None)
        return grpc.ssl_channel_credentials(root_certificates=self._read("ca"), private_key=key,
                                            certificate_chain=cert)

    def _read(self, which: str) -> bytes:
        path = getattr(self, f"{which}_file")
        try:
            return Path(path).read_bytes()
        except OSError as err:
            raise TLSConfigError(f"cannot read {self.flag_prefix}-{which}-file {path}: {err.strerror}") from None


def tls_files(args, prefix: str = "tls") -> TLSFiles:
    """The TLS files a parsed command line names: its --tls-* flags, or --worker-tls-* with prefix="worker_tls"."""
    return TLSFiles(*(getattr(args, f"{prefix}_{which}_file", "") for which in ("cert", "key", "ca")),
                    flag_prefix="--" + prefix.replace("_", "-"))


def open_channel(address: str, tls: TLSFiles = TLSFiles(), options=None) -> grpc.Channel:
    """A blocking channel to `address`, over TLS when `tls` names a CA."""
    credentials = tls.channel_credentials()
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def open_aio_channel(address: str, tls: TLSFiles = TLSFiles(), options=None) -> grpc.aio.Channel:
    """The asyncio twin of open_channel."""
    credentials = tls.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)
