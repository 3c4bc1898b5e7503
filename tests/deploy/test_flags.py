"""The flag table (nanoserve.flags) is the one source of every flag: the parsers of the CLI, the
services and the probe read it, the configs take their defaults from it, and `nanoserve up` hands
each child exactly the flags the table says both commands take."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve_kernels.backend import BACKENDS
from nanoserve_kernels.kv_quant import KV_CACHE_DTYPES
from nanoserve_model.config import DTYPES
from nanoserve import flags
from nanoserve_cli import replica
from nanoserve_cli.cli import build_parser
from scheduler_svc.config import SchedulerConfig
from tests.services.processes import CLI, ENV, free_port
from worker_svc.config import WorkerConfig


@pytest.fixture(autouse=True)
def no_flags_in_the_environment(monkeypatch):
    for f in flags.FLAGS:
        monkeypatch.delenv(f.env, raising=False)


def flag(name: str, command: str) -> flags.Flag:
    (found,) = [f for f in flags.flags_of(command) if f.name == name]
    return found


@pytest.mark.parametrize("command", flags.COMMANDS)
def test_a_command_takes_each_flag_once(command):
    names = [f.name for f in flags.flags_of(command)]
    assert len(names) == len(set(names)), names
    assert all(set(f.commands) <= set(flags.COMMANDS) for f in flags.FLAGS)


def test_configs_take_their_defaults_from_the_table():
    worker = flags.defaults("worker")
    for field in dataclasses.fields(WorkerConfig):
        assert field.name in worker, f"WorkerConfig.{field.name} is no worker flag"
        if field.default is not dataclasses.MISSING:
            assert field.default == worker[field.name], field.name
    scheduler = flags.defaults("scheduler")
    for name in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
        assert getattr(SchedulerConfig(1, 16, 64), name) == scheduler[name]


def test_a_worker_config_is_built_from_parsed_flags():
    args = flags.parse("worker", ["--model", "/m", "--block-size", "16", "--enforce-eager", "--rank", "1"])
    assert WorkerConfig.from_flags(args) == WorkerConfig(model="/m", block_size=16, enforce_eager=True, rank=1)


def test_fixed_choices_are_the_ones_the_worker_accepts():
    assert set(flag("--dtype", "worker").choices) == {"auto", *DTYPES}
    assert set(flag("--attention-backend", "worker").choices) == {"auto", *BACKENDS}
    assert flag("--kv-cache-dtype", "worker").choices == KV_CACHE_DTYPES
    assert set(flag("--device", "worker").choices) == {"auto", "cuda", "cpu"}


def test_environment_is_the_fallback_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("NANOSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("NANOSERVE_ENFORCE_EAGER", "yes")
    monkeypatch.setenv("NANOSERVE_DEVICE", "cpu")
    args = flags.parse("worker", [])
    assert (args.max_num_seqs, args.enforce_eager, args.device) == (7, True, "cpu")
    args = flags.parse("worker", ["--max-num-seqs", "9", "--no-enforce-eager", "--device", "cuda"])
    assert (args.max_num_seqs, args.enforce_eager, args.device) == (9, False, "cuda")


@pytest.mark.parametrize("env, argv, message", [
    ({"NANOSERVE_DEVICE": "gpu"}, [], "'gpu' is not one of auto, cuda, cpu (--device / NANOSERVE_DEVICE)"),
    ({"NANOSERVE_BLOCK_SIZE": "big"}, [], "'big' is not an integer (--block-size / NANOSERVE_BLOCK_SIZE)"),
    ({"NANOSERVE_ENFORCE_EAGER": "maybe"}, [], "'maybe' is not a switch value (--enforce-eager"),
    ({}, ["--dtype", "fp8"], "argument --dtype: 'fp8' is not one of auto, float32, bfloat16, float16"),
    ({}, ["--gpu-memory-utilization", "most"], "'most' is not a number"),
])
def test_a_bad_value_is_refused_with_where_it_came_from(monkeypatch, capsys, env, argv, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit:
        flags.parse("worker", argv)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_value_fails_only_the_commands_that_read_it(monkeypatch):
    monkeypatch.setenv("NANOSERVE_DEVICE", "gpu")
    assert flags.parse("scheduler", []).port == flags.SCHEDULER_PORT
    assert build_parser().parse_args(["generate", "hi"]).prompt == "hi"


def test_up_hands_each_child_exactly_the_flags_both_commands_take(tmp_path):
    up = build_parser().parse_args([
        "up", "--model", str(tmp_path), "--port", "6000", "--host", "127.0.0.2", "--worker-base-port", "7000",
        "--tensor-parallel-size", "2", "--max-num-seqs", "3", "--max-num-batched-tokens", "64", "--max-model-len", "99",
        "--dtype", "bfloat16", "--device", "cpu", "--attention-backend", "torch", "--kv-cache-dtype", "fp8",
        "--quantization", "fp8",
        "--block-size", "16",
        "--gpu-memory-utilization", "0.5", "--num-kv-blocks", "11", "--cpu-kv-cache-gb", "0.25", "--enforce-eager",
        "--seed", "5", "--tokenizer", "/tok", "--max-waiting", "8", "--no-enable-prefix-caching",
        "--worker-connect-timeout", "12", "--metrics-port", "9100", "--log-level", "debug", "--log-format", "json",
        "--load-format", "dummy", "--revision", "v1", "--download-dir", "/dl", "--max-n", "3", "--max-logprobs", "7",
        "--no-enable-chunked-prefill", "--long-prefill-token-threshold", "5",
        "--max-request-bytes", "1000", "--worker-restart-timeout", "9", "--step-timeout", "8", "--shutdown-timeout", "4",
        "--kv-events-config", '{"enable_kv_cache_events": true}'])
    launched = {"worker": replica.worker_command(up, tmp_path, 1, "127.0.0.1:4000"),
                "scheduler": replica.scheduler_command(up)}
    given = {"worker": dict(model=str(tmp_path), host="127.0.0.1", port=7001, rank=1, dist_init_addr="127.0.0.1:4000"),
             "scheduler": dict(host="127.0.0.2", workers="127.0.0.1:7000,127.0.0.1:7001")}
    for child, command in launched.items():
        assert command[:3] == [sys.executable, "-m", f"{child}_svc"]
        args = flags.parse(child, command[3:])
        shared = {f.dest for f in flags.shared("up", child)}
        assert {word[2:].replace("-", "_").removeprefix("no_") for word in command[3:] if word.startswith("--")} \
            == shared | set(given[child])
        for dest in shared:
            assert getattr(args, dest) == getattr(up, dest), (child, dest)
            assert getattr(args, dest) != flags.defaults(child)[dest] or dest == "model", (child, dest)
        for dest, value in given[child].items():
            assert getattr(args, dest) == value, (child, dest)


def test_to_argv_refuses_a_flag_the_command_does_not_take():
    with pytest.raises(KeyError, match="workers"):
        flags.to_argv("worker", {"workers": "a:1"})


@pytest.mark.parametrize("argv", [CLI + ["worker", "--help"], CLI + ["scheduler", "--help"],
                                  [sys.executable, "-m", "worker_svc", "--help"],
                                  [sys.executable, "-m", "scheduler_svc", "--help"],
                                  [sys.executable, "-m", "nanoserve.healthcheck", "--help"]])
def test_every_entry_point_lists_its_flags_from_the_table(argv):
    command = argv[argv.index("--help") - 1].split(".")[-1].removesuffix("_svc")
    out = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for f in flags.flags_of(command):
        assert f.name in out.stdout and f.env in out.stdout, f.name


def test_the_cli_refuses_bad_flags_before_starting_a_service():
    out = subprocess.run(CLI + ["worker", "--device", "gpu"], env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "nanoserve worker: error: argument --device: 'gpu' is not one of" in out.stderr


def test_the_cli_becomes_the_service_and_keeps_its_exit_status(tmp_path: Path):
    """`nanoserve scheduler` with no worker to reach: the scheduler's own log line and exit code 1."""
    out = subprocess.run(CLI + ["scheduler", "--workers", f"127.0.0.1:{free_port()}", "--port", str(free_port()),
                                "--worker-connect-timeout", "0.5"],
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "nanoserve.scheduler cannot start" in out.stderr
