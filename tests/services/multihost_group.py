"""A tensor-parallel group whose ranks stand on different "hosts", run inside a network namespace of
its own (test_multihost.py starts it under `unshare -n`; only loopback exists there). Rank r binds
and advertises 127.0.0.{r+2}, every rank on the same port as on hosts of their own, and meets the
others at rank 0's store; the scheduler drives them from 127.0.0.1. Seeded and greedy streams run
undisturbed, then again while rank 1 is SIGKILLed mid-stream and brought back by one of two
supervision policies: `group` (as `nanoserve up`: the whole group is replaced) or `alone` (as
kubelet under a LeaderWorkerSet with restartPolicy None, or compose: only the exited container is
restarted, and the survivors, which exit when they lose a peer, are restarted one by one too).

    unshare -n python -m tests.services.multihost_group MODEL_DIR RANKS POLICY LOG [WORKER_FLAG ...]

prints one JSON line: the tokens of both runs, each rank's listening addresses, restart counts and
how long the scheduler waited for the group (its "worker group back after" line).
"""
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from nanoserve.client import Client
from nanoserve_cli.supervision import WorkerGroupSupervisor
from tests.services.processes import ENV, REPO, start_scheduler, start_worker, stop, wait_serving
from tests.services.test_recovery import Streams, undisturbed

WORKER_PORT, STORE_PORT, SCHEDULER_ADDRESS = 50061, 29500, "127.0.0.1:50051"
FLAGS = ("--block-size", "16", "--num-kv-blocks", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "256")
NUM_REQUESTS = 6
IFREQ, SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = "16sH22x", 0x8913, 0x8914, 0x1  # struct ifreq: name, flags (<linux/if.h>)
TCP_LISTEN = "0A"  # the state column of /proc/net/tcp (<net/tcp_states.h>)


def host(rank: int) -> str:
    return f"127.0.0.{rank + 2}"


def bring_up_loopback() -> None:
    """In a fresh namespace loopback is down: up, and the whole 127.0.0.0/8 routes to it, each rank's
    address included. (Outside one, as on the GPU machine, it is up already.) An ioctl, not `ip`: the
    GPU machine's image has no iproute2."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack(IFREQ, fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0)))[1]
        if not flags & IFF_UP:
            fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))


class Group:
    """The ranks as processes, kept running by `policy`'s supervisor on a thread of its own."""

    def __init__(self, model: Path, ranks: int, policy: str, log: Path, flags: list[str]):
        self.model, self.ranks, self.policy, self.log = model, ranks, policy, log
        self.flags = [*FLAGS, *flags]
        self.addresses = [f"{host(rank)}:{WORKER_PORT}" for rank in range(ranks)]
        self.restarts = 0
        self.stopped = threading.Event()
        if policy == "group":
            self.supervisor = WorkerGroupSupervisor(lambda _standbys: self._start_all(), self.addresses, self._describe,
                                                    self._failure, max_restarts=5, hang_seconds=300, log=self._note)
            self.supervisor.start()
        else:
            self.procs = self._start_all()
        threading.Thread(target=self._supervise, daemon=True).start()

    @property
    def live(self) -> list[subprocess.Popen]:
        return self.supervisor.procs if self.policy == "group" else self.procs

    def _start(self, rank: int) -> subprocess.Popen:
        return start_worker(self.model, WORKER_PORT, "--host", host(rank), "--advertise-host", host(rank), "--rank",
                            str(rank), "--tensor-parallel-size", str(self.ranks), "--dist-init-addr",
                            f"{host(0)}:{STORE_PORT}", *self.flags, log=self.log)

    def _start_all(self) -> list[subprocess.Popen]:
        return [self._start(rank) for rank in range(self.ranks)]

    def _describe(self, proc: subprocess.Popen) -> str:
        return f"worker rank {self.live.index(proc)} (pid {proc.pid})"

    def _failure(self, proc: subprocess.Popen) -> str:
        return f"{self._describe(proc)} exited with code {proc.returncode}"

    def _note(self, line: str) -> None:
        self.restarts += 1
        with self.log.open("a") as out:
            out.write(line + "\n")

    def _supervise(self) -> None:
        while not self.stopped.wait(0.2):
            if self.policy == "group":
                self.supervisor.check()
                continue
            for rank, proc in enumerate(self.procs):
                if proc.poll() is not None:  # as kubelet does: this container alone, the others keep running
                    self._note(f"rank {rank} exited with code {proc.returncode}: restarting it alone")
                    self.procs[rank] = self._start(rank)

    def stop(self) -> None:
        self.stopped.set()
        stop(self.live)


def listening(pids: list[int]) -> list[list[str]]:
    """Each process's listening TCP addresses (host only; IPv4-mapped ones as IPv4), from /proc (the
    GPU machine's image has no `ss`)."""
    hosts = {}  # socket inode -> address
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            _, local, _, state, *_, inode = line.split()[:10]
            if state == TCP_LISTEN:
                hosts[f"socket:[{inode}]"] = address(local.partition(":")[0])
    return [sorted({hosts[link] for link in fd_links(pid) if link in hosts}) for pid in pids]


def address(hex_host: str) -> str:
    """/proc/net/tcp's host: 32-bit words in the machine's (little-endian) order."""
    raw = b"".join(bytes.fromhex(hex_host[i:i + 8])[::-1] for i in range(0, len(hex_host), 8))
    ip = ipaddress.ip_address(raw)
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def fd_links(pid: int) -> list[str]:
    links = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            links.append(os.readlink(fd))
        except OSError:  # closed meanwhile
            pass
    return links


def can_unshare() -> bool:
    """Whether this process may make a network namespace (root, or user namespaces)."""
    return shutil.which("unshare") is not None and \
        subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def run(model: Path, ranks: int, policy: str, log: Path, *flags: str, isolated: bool = True,
        env: dict[str, str] = ENV, timeout: float = 600) -> dict:
    """main() in a process of its own (under `unshare -n` when `isolated`): its JSON line. On a
    timeout its whole process group goes, the ranks and scheduler it started included."""
    argv = [sys.executable, "-m", "tests.services.multihost_group", str(model), str(ranks), policy, str(log), *flags]
    proc = subprocess.Popen(["unshare", "-n", *argv] if isolated else argv, cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.splitlines()[-1])


def main(model: Path, ranks: int, policy: str, log: Path, flags: list[str]) -> dict:
    bring_up_loopback()
    group = Group(model, ranks, policy, log, flags)
    scheduler = start_scheduler(group.addresses, int(SCHEDULER_ADDRESS.rsplit(":")[1]), log=log)
    try:
        wait_serving(SCHEDULER_ADDRESS, [scheduler], log, timeout=300)
        addresses = listening([proc.pid for proc in group.live])
        expected = undisturbed(SCHEDULER_ADDRESS, NUM_REQUESTS)
        streams = Streams(SCHEDULER_ADDRESS, NUM_REQUESTS)
        streams.wait_received(2 * NUM_REQUESTS)
        killed_at = time.monotonic()
        os.kill(group.live[1].pid, signal.SIGKILL)
        received_at_kill = streams.received
        got = streams.join()
        with Client(SCHEDULER_ADDRESS) as client:
            running = client.stats().num_running
        back = re.findall(r"worker group back after ([\d.]+)s", log.read_text())
        return {"expected": expected, "got": got, "listening": addresses, "restarts": group.restarts,
                "received_at_kill": received_at_kill, "seconds_to_the_end": time.monotonic() - killed_at,
                "group_back_after_seconds": float(back[-1]) if back else None, "running_after": running}
    finally:
        stop([scheduler])
        group.stop()


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5:])))
