"""The `nanoserve` command's own behaviour, without a server: --version, the default port of an
address, numbers out of range refused in one line, and JSON log lines."""
import json
import logging
import subprocess

import pytest

from nanoserve import __version__, flags
from nanoserve.client import with_default_port
from nanoserve.logs import configure_logging
from nanoserve_cli.cli import build_parser
from tests.services.processes import CLI, ENV


@pytest.fixture(autouse=True)
def no_flags_in_the_environment(monkeypatch):
    for f in flags.FLAGS:
        monkeypatch.delenv(f.env, raising=False)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"nanoserve {__version__}"


@pytest.mark.parametrize("address, target", [
    ("localhost", "localhost:50051"), ("10.0.0.7", "10.0.0.7:50051"), ("localhost:7000", "localhost:7000"),
    ("[::1]", "[::1]:50051"), ("[::1]:7000", "[::1]:7000"), ("dns:///svc:7000", "dns:///svc:7000")])
def test_an_address_without_a_port_means_the_schedulers_port(address, target):
    assert with_default_port(address) == target


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--max-tokens", "0"], "argument --max-tokens: '0' is outside 1..4294967295"),
    (["generate", "hi", "--max-tokens", "5000000000"], "'5000000000' is outside 1..4294967295"),
    (["generate", "hi", "--seed", "-2"], "argument --seed: '-2' is outside -1..18446744073709551615"),
    (["up", "--port", "70000"], "argument --port: '70000' is outside 1..65535 (--port / NANOSERVE_PORT)"),
])
def test_numbers_out_of_range_end_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_tls_file_that_cannot_be_read_ends_in_one_line(tmp_path):
    out = subprocess.run(CLI + ["info", "--tls-ca-file", str(tmp_path / "nope.pem")], env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == f"error: cannot read --tls-ca-file {tmp_path / 'nope.pem'}: No such file or directory"


def test_json_log_lines_carry_the_level(capsys):
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    configure_logging("warning", "json")
    try:
        logging.getLogger("nanoserve.test").info("not written")
        logging.getLogger("nanoserve.test").error("port %d is busy", 5)
    finally:
        root.handlers[:], root.level = handlers, level
    (line,) = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert (record["level"], record["logger"], record["message"]) == ("ERROR", "nanoserve.test", "port 5 is busy")
