"""Failures under load (issues 16 and 37): `nanoserve up` serves a steady online load while a worker
rank (--kill rank) or a whole replica, launcher and children (--kill replica, with --replicas 2 or
more), is killed (SIGKILL) every --kill-every seconds; every request must still complete. The clients
are given every replica's address (nanoserve.client fails a broken stream over to the next), and a
killed replica is started again, as its supervisor would.

    python bench/chaos.py                                   # CPU, the demo model, 10 kills of a rank
    python bench/chaos.py --replicas 2 --kill replica --kills 3 --kill-every 20   # CPU, whole replicas
    python bench/chaos.py --model DIR --extra "--load-format dummy" --rate 8 --kills 10   # on a GPU
    python bench/chaos.py --extra "--device cpu --num-kv-blocks 2048 --standby-workers" --kills 3  # standbys
    python bench/chaos.py --model DIR --replicas 2 --replica-gpus 0 1 --kill replica --rate 8 --kill-every 30

Reports requests completed and failed (the target is 0 failed), the recovery time of each kill
(the kill to the first token any request receives after it) and the extra latency per failure
(mean end-to-end latency of the requests in flight at a kill, less that of the requests no kill
touched); for rank kills, where each restart's time went (bench/restart_split.py: detection, the
rank's start-up phases, the handshake, the first token). Tokens arriving in the first
KILL_GRACE_SECONDS after a kill are steps that completed before it, still on their way, so they do
not count as recovered. Prints a table, writes JSON.
"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto"), str(REPO / "bench")]

from nanoserve.client import Client  # noqa: E402
from nanoserve.standby import PROCESS_NAME as STANDBY_PROCESS_NAME  # noqa: E402
from nanoserve_cli.launcher import free_port, wait_serving  # noqa: E402
from restart_split import describe, restart_splits  # noqa: E402
from serve import arrival_times, make_requests  # noqa: E402

KILL_GRACE_SECONDS = 0.25


@dataclass
class RequestSpec:
    arrival: float        # seconds after the load starts
    prompt: list[int]
    max_tokens: int


def online_requests(rate: float, duration: float, seed: int = 0) -> list[RequestSpec]:
    """Poisson arrivals at `rate` per second for about `duration` seconds, prompts of 100-1,024
    random token ids and outputs of 100-512 (DESIGN §8's online workload), drawn by the serve
    benchmark's generator."""
    count = max(1, round(rate * duration))
    requests = make_requests(count, (100, 1024), (100, 512), seed=seed)
    return [RequestSpec(at, r.prompt, r.max_tokens) for r, at in zip(requests, arrival_times(count, rate, seed))]


@dataclass
class Outcome:
    started: float = 0.0
    token_times: list[float] = field(default_factory=list)
    ended: float = 0.0
    error: str = ""
    failovers: list[str] = field(default_factory=list)  # the replicas its stream moved to


def run_request(addresses: list[str], spec: RequestSpec, t0: float, outcome: Outcome) -> None:
    time.sleep(max(0.0, t0 + spec.arrival - time.monotonic()))
    outcome.started = time.monotonic()
    try:
        with Client(addresses, on_failover=lambda event: outcome.failovers.append(event.to_address)) as client:
            for message in client.stream(spec.prompt, max_tokens=spec.max_tokens, temperature=0.6, seed=len(spec.prompt),
                                         ignore_eos=True, timeout=900):
                now = time.monotonic()
                outcome.token_times.extend([now] * len(message.token_ids))
    except grpc.RpcError as err:
        outcome.error = f"{err.code().name}: {err.details()}"
    outcome.ended = time.monotonic()


def worker_pids(launcher: subprocess.Popen) -> list[int]:
    """The launcher's live worker ranks (their parent is the launcher, their command worker_svc), not
    its waiting standbys (--standby-workers: they name themselves so)."""
    return [pid for pid, argv in children(launcher)
            if b"worker_svc" in argv.split(b"\0") and process_name(pid) != STANDBY_PROCESS_NAME]


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def children(launcher: subprocess.Popen) -> list[tuple[int, bytes]]:
    """The launcher's live children: (pid, command line)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            argv = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if ppid == launcher.pid:
            found.append((int(stat.parent.name), argv))
    return found


class Replicas:
    """`nanoserve up` processes, one per replica, each started again after a kill."""

    def __init__(self, args: argparse.Namespace, log: Path):
        self.args, self.log = args, log
        self.ports = [(free_port(), free_port()) for _ in range(args.replicas)]  # (public, worker base) each
        self.addresses = [f"127.0.0.1:{port}" for port, _ in self.ports]
        self.launchers = [self._start(index) for index in range(args.replicas)]
        for address, launcher in zip(self.addresses, self.launchers):
            wait_serving(address, [launcher], 900)

    def _start(self, index: int) -> subprocess.Popen:
        args = self.args
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "proto"),
                                                                        os.environ.get("PYTHONPATH")]))}
        if args.replica_gpus:
            env["CUDA_VISIBLE_DEVICES"] = args.replica_gpus[index]
        port, worker_port = self.ports[index]
        cmd = [sys.executable, "-m", "nanoserve_cli", "up", "--port", str(port), "--worker-base-port",
               str(worker_port), "--max-worker-restarts", str(args.kills + 1),
               *(["--model", args.model] if args.model else []), *args.extra.split()]
        return subprocess.Popen(cmd, env=env, stdout=self.log_of(index).open("ab"), stderr=subprocess.STDOUT)

    def log_of(self, index: int) -> Path:
        return self.log.with_name(f"{self.log.stem}_{index}{self.log.suffix}")

    def kill_rank(self, rng: random.Random) -> bool:
        pids = [pid for launcher in self.launchers for pid in worker_pids(launcher)]
        if pids:
            os.kill(rng.choice(pids), signal.SIGKILL)
        return bool(pids)

    def kill_replica(self, rng: random.Random) -> bool:
        """SIGKILLs one replica's launcher, then its children (the launcher first: it would restart them),
        and starts it again."""
        index = rng.randrange(len(self.launchers))
        launcher = self.launchers[index]
        procs = children(launcher)
        launcher.kill()
        launcher.wait()
        for pid, _ in procs:
            os.kill(pid, signal.SIGKILL)
        self.launchers[index] = self._start(index)
        return True

    def stop(self) -> None:
        for launcher in self.launchers:
            launcher.send_signal(signal.SIGTERM)
        for launcher in self.launchers:
            launcher.wait(timeout=60)


def killer(replicas: Replicas, kill: str, every: float, count: int, kills: list[tuple[float, float]],
           done: threading.Event) -> None:
    """Kills every `every` seconds; `kills` gets each kill's time, monotonic and wall clock (the logs')."""
    rng = random.Random(1)
    for _ in range(count):
        if done.wait(every):
            return
        killed_at = time.monotonic(), time.time()
        if (replicas.kill_replica if kill == "replica" else replicas.kill_rank)(rng):
            kills.append(killed_at)


def summarize(specs: list[RequestSpec], outcomes: list[Outcome], kills: list[float]) -> dict:
    tokens = sorted(t for o in outcomes for t in o.token_times)
    recoveries = []
    for kill in kills:
        after = next((t for t in tokens if t > kill + KILL_GRACE_SECONDS), None)
        recoveries.append(None if after is None else after - kill)
    done = [o for o in outcomes if not o.error]
    hit = [o for o in done if any(o.started <= k <= o.ended for k in kills)]
    clean = [o for o in done if o not in hit]
    mean = lambda rows: statistics.mean(o.ended - o.started for o in rows) if rows else None  # noqa: E731
    extra = None if not hit or not clean else mean(hit) - mean(clean)
    kills_per_hit = statistics.mean(sum(o.started <= k <= o.ended for k in kills) for o in hit) if hit else 0
    return {"requests": len(specs), "completed": len(done), "failed": len(outcomes) - len(done),
            "failovers": sum(len(o.failovers) for o in outcomes),
            "errors": sorted({o.error for o in outcomes if o.error})[:5], "kills": len(kills),
            "recovery_seconds": recoveries,
            "extra_latency_per_failure_seconds": None if extra is None else extra / max(kills_per_hit, 1),
            "mean_e2e_undisturbed_seconds": mean(clean), "mean_e2e_disturbed_seconds": mean(hit)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="checkpoint; default: the demo model")
    p.add_argument("--extra", default="--device cpu --block-size 16 --num-kv-blocks 2048",
                   help="more `nanoserve up` flags, space separated")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second")
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--kill-every", type=float, default=15.0, help="seconds between kills")
    p.add_argument("--kill", choices=("rank", "replica"), default="rank",
                   help="what each kill takes down: a worker rank, or a whole replica (needs --replicas 2+)")
    p.add_argument("--replicas", type=int, default=1, help="`nanoserve up` replicas the clients fail over between")
    p.add_argument("--replica-gpus", nargs="*", default=[], help="CUDA_VISIBLE_DEVICES of each replica")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "chaos.json"))
    args = p.parse_args()
    if args.kill == "replica" and args.replicas < 2:
        p.error("--kill replica needs --replicas 2 or more: the clients fail over to another replica")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    replicas = Replicas(args, out.with_suffix(".log"))
    specs = online_requests(args.rate, args.kills * args.kill_every + args.kill_every / 2)
    outcomes = [Outcome() for _ in specs]
    kill_times: list[tuple[float, float]] = []
    done = threading.Event()
    t0 = time.monotonic()
    threads = [threading.Thread(target=run_request, args=(replicas.addresses, spec, t0, outcome), daemon=True)
               for spec, outcome in zip(specs, outcomes)]
    chaos = threading.Thread(target=killer, args=(replicas, args.kill, args.kill_every, args.kills, kill_times, done),
                             daemon=True)
    try:
        for thread in threads:
            thread.start()
        chaos.start()
        for thread in threads:
            thread.join()
    finally:
        done.set()
        replicas.stop()
    kills = [at for at, _ in kill_times]
    result = summarize(specs, outcomes, kills) | {"command": " ".join(sys.argv), "rate": args.rate,
                                                  "kill_every_seconds": args.kill_every, "kill": args.kill,
                                                  "replicas": args.replicas}
    if args.kill == "rank":
        logs = [replicas.log_of(index) for index in range(args.replicas)]
        to_wall = kill_times[0][1] - kill_times[0][0] if kill_times else 0.0  # monotonic to wall clock
        tokens = sorted(to_wall + t for o in outcomes for t in o.token_times)
        result["restarts"] = restart_splits(logs, [wall for _, wall in kill_times], tokens)
    out.write_text(json.dumps(result, indent=2))
    recovered = [r for r in result["recovery_seconds"] if r is not None]
    print(f"requests {result['requests']}: completed {result['completed']}, failed {result['failed']} "
          f"{result['errors'] or ''}; streams failed over {result['failovers']} time(s)")
    if recovered:
        print(f"kills {result['kills']}: recovery (kill to the next token) mean {statistics.mean(recovered):.2f} s, "
              f"max {max(recovered):.2f} s")
    for number, split in enumerate(result.get("restarts", []), 1):
        print(f"kill {number}: {describe(split)}")
    if after_back := [split["recovery"] for split in result.get("restarts", []) if split["recovery"] is not None]:
        print(f"recovery (kill to the first token after the group is back) mean {statistics.mean(after_back):.2f} s, "
              f"max {max(after_back):.2f} s")
    if result["extra_latency_per_failure_seconds"] is not None:
        print(f"extra latency per failure {result['extra_latency_per_failure_seconds']:.2f} s "
              f"(e2e {result['mean_e2e_disturbed_seconds']:.2f} s in flight at a kill, "
              f"{result['mean_e2e_undisturbed_seconds']:.2f} s otherwise)")


if __name__ == "__main__":
    main()
