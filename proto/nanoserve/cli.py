"""`nanoserve` command line: worker, scheduler, up (local launcher) and generate.

Every flag falls back to an environment variable NANOSERVE_<FLAG> (e.g. NANOSERVE_TENSOR_PARALLEL_SIZE),
so containers can be configured either way. Heavy imports (torch) happen only in `worker`.
"""
import argparse
import dataclasses
import os
import sys

DEFAULT_SCHEDULER_PORT = 50051
DEFAULT_WORKER_PORT = 50061
_FLAGS: dict[str, dict[str, tuple[str, type]]] = {}  # subcommand -> flag -> (dest, type)


def _env_default(dest: str, default, kind):
    raw = os.environ.get("NANOSERVE_" + dest.upper())
    if raw is None:
        return default
    if kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return kind(raw)


def _add(parser: argparse.ArgumentParser, flag: str, default, help: str, kind=None) -> None:
    kind = kind or type(default)
    dest = flag.lstrip("-").replace("-", "_")
    _FLAGS.setdefault(parser.prog.split()[-1], {})[flag] = (dest, kind)
    value = _env_default(dest, default, kind)
    if kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=help)
    else:
        parser.add_argument(flag, type=kind, default=value, help=help + f" (default: {value})")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Limits both the scheduler and the workers must know."""
    _add(p, "--max-num-seqs", 256, "most sequences running at once")
    _add(p, "--max-num-batched-tokens", 16384, "most tokens computed in one step")
    _add(p, "--max-model-len", 0, "prompt + output limit per sequence; 0 = the model's own", int)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    _add(p, "--dtype", "auto", "auto (from config.json), float32, bfloat16 or float16")
    _add(p, "--device", "auto", "auto (cuda when available), cuda or cpu")
    _add(p, "--tensor-parallel-size", 1, "number of ranks the model is split across")
    _add(p, "--dist-init-addr", "127.0.0.1:29500", "host:port where the ranks meet")
    _add(p, "--block-size", 256, "tokens per KV block (flash-attn needs a multiple of 256)")
    _add(p, "--gpu-memory-utilization", 0.9, "fraction of GPU memory the worker may use")
    _add(p, "--num-kv-blocks", 0, "force the KV block count; 0 = size from memory")
    _add(p, "--cpu-kv-cache-gb", 1.0, "KV cache size on CPU, in GiB")
    _add(p, "--enforce-eager", False, "disable CUDA graphs", bool)
    _add(p, "--attention-backend", "auto", "auto, flash-attn, triton or torch")
    _add(p, "--seed", 0, "seed for unseeded sampling")


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    _add(p, "--tokenizer", "", "directory with tokenizer.json; default: the model the workers serve")
    _add(p, "--max-waiting", 4096, "most requests queued before RESOURCE_EXHAUSTED")
    _add(p, "--enable-prefix-caching", True, "reuse KV blocks of shared prompt prefixes", bool)
    _add(p, "--worker-connect-timeout", 300.0, "seconds to wait for every worker at start-up")
    _add(p, "--metrics-port", 0, "port serving Prometheus metrics at /metrics; 0 = off")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description="gRPC LLM server")
    sub = parser.add_subparsers(dest="command", required=True)

    worker = sub.add_parser("worker", help="serve one tensor-parallel rank of a model")
    _add(worker, "--model", "", "checkpoint directory (config.json + *.safetensors)")
    _add(worker, "--host", "0.0.0.0", "address to listen on")
    _add(worker, "--port", DEFAULT_WORKER_PORT, "port to listen on")
    _add(worker, "--rank", 0, "this worker's rank")
    add_engine_args(worker)
    add_worker_args(worker)

    sched = sub.add_parser("scheduler", help="serve the public LLM API, driving the workers")
    _add(sched, "--workers", f"127.0.0.1:{DEFAULT_WORKER_PORT}", "worker addresses, rank order")
    _add(sched, "--host", "0.0.0.0", "address to listen on")
    _add(sched, "--port", DEFAULT_SCHEDULER_PORT, "port to listen on")
    add_engine_args(sched)
    add_scheduler_args(sched)

    up = sub.add_parser("up", help="start a scheduler and its workers as local processes")
    _add(up, "--model", "", "checkpoint directory; default: the built-in tiny demo model")
    _add(up, "--host", "127.0.0.1", "address the scheduler listens on")
    _add(up, "--port", DEFAULT_SCHEDULER_PORT, "scheduler port")
    _add(up, "--worker-base-port", DEFAULT_WORKER_PORT, "rank r listens on this port + r")
    add_engine_args(up)
    add_worker_args(up)
    add_scheduler_args(up)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt", help="prompt text")
    _add(gen, "--address", f"127.0.0.1:{DEFAULT_SCHEDULER_PORT}", "scheduler address")
    _add(gen, "--max-tokens", 64, "most tokens to generate")
    _add(gen, "--temperature", 0.0, "0 = greedy")
    _add(gen, "--seed", -1, "sampling seed; -1 = none")
    _add(gen, "--ignore-eos", False, "keep going past end-of-sequence", bool)
    return parser


def forward_flags(subcommand: str, args: argparse.Namespace, skip: set[str]) -> list[str]:
    """The command-line flags of `subcommand` that reproduce the values in `args` (for `up`)."""
    out = []
    if not _FLAGS:
        build_parser()
    for flag, (dest, kind) in _FLAGS[subcommand].items():
        if dest in skip or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if kind is bool:
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def worker_config(args: argparse.Namespace):
    from worker_svc.config import WorkerConfig
    names = {f.name for f in dataclasses.fields(WorkerConfig)}
    return WorkerConfig(**{k: v for k, v in vars(args).items() if k in names})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        from worker_svc.server import serve_worker
        return serve_worker(worker_config(args), args.host, args.port)
    if args.command == "scheduler":
        from scheduler_svc.server import serve_scheduler
        return serve_scheduler(args)
    if args.command == "up":
        from nanoserve.launcher import run_local
        return run_local(args)
    from nanoserve.client import stream_to_terminal
    return stream_to_terminal(args)


if __name__ == "__main__":
    sys.exit(main())
