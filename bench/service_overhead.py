"""The scheduler service's own ceiling: the throughput workload (docs/benchmarks.md) through a real scheduler process
and real gRPC clients, against the real worker service around a null runner that answers every
step at once. Whatever time a step takes here is host time (scheduling, protobuf, streaming tokens
to the clients, the worker's step loop) that the GPU must hide; above the GPU's own step time, the
services are the bottleneck.

With --step-ms the null runner stands in for a GPU that takes that long a step: steps queue on it
as they do on a real worker (the scheduler keeps several in flight), and `device_idle_ms_per_step`
is how long it waited for the services between steps, the figure that costs throughput on the
H100 (the throughput workload's decode steps take ~6.5 ms there at 256 sequences). With --launch-ms
each launch also holds the worker's host for that long, as the runner's Python does (~0.45 ms a
batch-1 step of the 0.6B shape on the H100 since session 8; 0.9 before): `--num-seqs 1 --step-ms 1
--launch-ms 0.45` is batch-1 decode's service ceiling.

The null worker runs in a process of its own, as a worker does, so that only its own threads
(launcher, replies, gRPC's) share its GIL; on exit it prints how long the emulated device waited
before each decode step (percentiles, and the gaps over 1 ms with their step ids), which the average
alone hides. Steps that start a sequence are left out, as GetStats's decode idle leaves them out: the
device waits before them for a client's new request (the benchmark's own warm-up request ends after
16 steps, and the measured ones start after it), not for the services.

    python bench/service_overhead.py [--num-seqs 256] [--step-ms 6.5] [--launch-ms 0.45] [--extra "--max-num-seqs 128"]
"""
import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Iterator

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto"), str(REPO / "bench")]

from nanoserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from nanoserve.wire import STEP_FORMAT  # noqa: E402
from nanoserve_cli.cache import cache_dir  # noqa: E402
from nanoserve_cli.launcher import free_port, stop_all, wait_serving  # noqa: E402
from worker_svc.config import WorkerConfig  # noqa: E402
from worker_svc.startup_phases import StartupPhases  # noqa: E402
from latency import percentiles  # noqa: E402
from throughput import drive, workload  # noqa: E402


class NullStep:
    """A launched step whose device work ends at `done_at` (perf_counter seconds)."""

    def __init__(self, done_at: float, tokens: list[int], busy: float, idle: float, host: float):
        self.done_at, self.tokens, self.busy, self.idle, self.host = done_at, tokens, busy, idle, host

    def reply(self, step_id: int) -> worker_pb2.StepResponse:
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return worker_pb2.StepResponse(step_id=step_id, token_ids=self.tokens, busy_seconds=self.busy,
                                       idle_seconds=self.idle, host_seconds=self.host)

    def after_reply(self) -> None:
        """Nothing waits for a null step's tokens."""


class NullRunner:
    """A runner that computes nothing, behind the real worker service (its step loop included):
    token 5 for every sampled entry. A launch holds the host (and the GIL) for --launch-ms, as the
    runner's Python does, and queues --step-ms of work on an emulated device."""

    def __init__(self, tokenizer_dir: str, step_ms: float = 0.0, launch_ms: float = 0.0):
        self.info_message = worker_pb2.WorkerInfo(
            model=tokenizer_dir, rank=0, world_size=1, dtype="bfloat16", block_size=256, max_kv_blocks=2446,
            vocab_size=151936, max_model_len=4096, eos_token_ids=[151645], attention_backend="none",
            device="none", max_num_seqs=256, max_num_batched_tokens=16384, model_fingerprint="null",
            step_format=STEP_FORMAT)
        self.step_seconds, self.launch_seconds = step_ms / 1e3, launch_ms / 1e3
        self.device_free = None  # when the emulated device finishes the work queued so far
        self.idles: list[tuple[int, float]] = []  # (step id, the device's wait before it): decode steps
        self.config, self.phases = WorkerConfig(tokenizer_dir), StartupPhases()  # the service logs them at start-up
        self.kv_sized = True  # its KV pool is the fixed max_kv_blocks above: nothing to measure at the handshake

    def info(self) -> worker_pb2.WorkerInfo:
        return self.info_message

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def launch(self, request: worker_pb2.StepRequest) -> NullStep:
        started = time.perf_counter()
        while time.perf_counter() - started < self.launch_seconds:
            pass
        now = time.perf_counter()
        if self.device_free is None:  # the first step: the device had nothing to wait for
            idle, self.device_free = 0.0, now
        else:
            idle = max(0.0, now - self.device_free)  # the device ran out of queued steps
            if max(request.num_token_ids, default=0) <= 1 and not any(item.reset for item in request.extras):
                self.idles.append((request.step_id, idle))
        self.device_free = max(now, self.device_free) + self.step_seconds
        tokens = [5] * sum(request.sample)
        return NullStep(self.device_free, tokens, self.step_seconds, idle, now - started)


def idle_report(idles: list[tuple[int, float]]) -> str:
    """The emulated device's waits before its decode steps (step id, seconds), in milliseconds."""
    if not idles:
        return "no decode steps"
    waits = [1e3 * idle for _, idle in idles]
    ms = percentiles(waits)
    long_gaps = [step for step, idle in idles if idle > 1e-3]
    return (f"device idle before {ms['n']} decode steps: p50 {ms['p50']:.3f}, p90 {ms['p90']:.3f}, "
            f"p99 {ms['p99']:.3f}, max {max(waits):.3f} ms; {len(long_gaps)} gaps over 1 ms (before steps "
            f"{long_gaps[:12]}), {sum(waits):.1f} ms in all")


def serve_null_worker(port: int, tokenizer: str, step_ms: float, launch_ms: float) -> None:
    """The worker service around a NullRunner on `port` until SIGTERM; then its idle report (stderr)."""
    from worker_svc.server import GIL_SWITCH_SECONDS, WorkerService  # torch: only where a worker is wanted
    sys.setswitchinterval(GIL_SWITCH_SECONDS)  # as serve_worker sets it
    runner = NullRunner(tokenizer, step_ms, launch_ms)
    worker = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService(runner), worker)
    worker.add_insecure_port(f"127.0.0.1:{port}")
    worker.start()
    signal.signal(signal.SIGTERM, lambda *_: worker.stop(0))
    worker.wait_for_termination()
    print(idle_report(runner.idles), file=sys.stderr, flush=True)


@contextlib.contextmanager
def null_service(tokenizer: str, extra: str = "", step_ms: float = 0.0, launch_ms: float = 0.0,
                 log: Path | None = None) -> Iterator[str]:
    """A scheduler process over a null worker process (the tokenizer's directory lends the model's
    name and tokenizer): the scheduler's address while they run. The scheduler's log goes to `log`
    (appended) when given, else to this process's stderr."""
    if not (Path(tokenizer) / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "nanoserve_cli.demo_model"], check=True, cwd=REPO)  # fetches it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto")])}
    worker_port, port = free_port(), free_port()
    worker = subprocess.Popen([sys.executable, __file__, "--null-worker-port", str(worker_port), "--tokenizer",
                               tokenizer, "--step-ms", str(step_ms), "--launch-ms", str(launch_ms)], env=env)
    with log.open("ab") if log else contextlib.nullcontext() as output:
        scheduler = subprocess.Popen([sys.executable, "-m", "scheduler_svc", "--port", str(port), "--workers",
                                      f"127.0.0.1:{worker_port}", *extra.split()], env=env, stdout=output,
                                     stderr=subprocess.STDOUT if log else None)
    try:
        wait_serving(f"127.0.0.1:{port}", [scheduler, worker], timeout=120)
        yield f"127.0.0.1:{port}"
    finally:
        stop_all([scheduler, worker])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokenizer", default=str(cache_dir() / "tokenizer-qwen3"))
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=0.0, help="the emulated device's time a step (default: none)")
    p.add_argument("--launch-ms", type=float, default=0.0,
                   help="the runner's host time a step launch, holding the GIL (the H100's 0.6B batch-1 launch: ~0.45)")
    p.add_argument("--extra", default="", help="more `nanoserve scheduler` flags, space separated")
    p.add_argument("--null-worker-port", type=int, default=0, help=argparse.SUPPRESS)  # null_service's worker
    args = p.parse_args()
    if args.null_worker_port:
        serve_null_worker(args.null_worker_port, args.tokenizer, args.step_ms, args.launch_ms)
        return
    with null_service(args.tokenizer, args.extra, args.step_ms, args.launch_ms) as address:
        result = asyncio.run(drive(address, workload(args.num_seqs, 1024, 1024)))
    steps = result["prefill_steps"] + result["decode_steps"]
    summary = {"output_tokens": result["output_tokens"], "seconds": result["seconds"],
               "tok_per_s": result["tok_per_s"], "steps": steps, "ms_per_step": 1e3 * result["seconds"] / steps,
               "step_ms": args.step_ms, "launch_ms": args.launch_ms,
               "device_idle_ms_per_step": result["gpu_wait_between_decode_steps_ms"]}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
