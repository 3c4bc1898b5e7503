"""One replica of `nanoserve up`: a scheduler, its worker ranks kept running (supervision.py) and,
with an OpenAI port, its gateway, on the ports and GPUs layout.py gives it.

Each child is the service itself (`python -m worker_svc`, `python -m scheduler_svc`,
`python -m gateway_svc`), never imported here. It gets the flags `up` shares with its command in the
flag table, as `up` parsed them, plus the ones only the launcher can know (ports, ranks, addresses).
"""
import subprocess
import sys
import threading
from argparse import Namespace
from pathlib import Path
from typing import Callable

from nanoserve import flags
from nanoserve.listen import PortReservation
from nanoserve.standby import GO, STANDBY_ENV
from nanoserve_cli import layout
from nanoserve_cli.children import Child, describe, failure
from nanoserve_cli.supervision import WorkerGroupSupervisor

SERVICE_MODULES = {"worker": "worker_svc", "scheduler": "scheduler_svc", "gateway": "gateway_svc"}  # command -> module


def service_command(command: str, args: Namespace, **given) -> list[str]:
    """`command`'s service with the flags `up` shares with it, as `up` parsed them, and `given`."""
    shared = {flag.dest: getattr(args, flag.dest) for flag in flags.shared("up", command)}
    return [sys.executable, "-m", SERVICE_MODULES[command], *flags.to_argv(command, shared | given)]


def worker_command(args: Namespace, model: Path, rank: int, dist_init_addr: str, replica: int = 0) -> list[str]:
    return service_command("worker", args, model=model, host="127.0.0.1",
                           port=layout.worker_ports(args, replica)[rank], rank=rank, dist_init_addr=dist_init_addr)


def scheduler_command(args: Namespace, replica: int = 0) -> list[str]:
    workers = ",".join(f"127.0.0.1:{port}" for port in layout.worker_ports(args, replica))
    return service_command("scheduler", args, host=args.host, port=layout.scheduler_port(args, replica),
                           workers=workers, metrics_port=layout.metrics_port(args, replica))


def gateway_command(args: Namespace, replica: int = 0) -> list[str]:
    """The replica's gateway: on --host with one replica, on loopback behind the router with more."""
    return service_command("gateway", args, scheduler=f"{args.host}:{layout.scheduler_port(args, replica)}",
                           host=layout.gateway_host(args), port=layout.gateway_port(args, replica))


class Replica:
    """Starts one replica's processes; `front` are those that take requests (scheduler, gateway),
    `workers` the ranks' supervisor."""

    def __init__(self, args: Namespace, model: Path, index: int, env: dict[str, str], gpus: list[str] | None,
                 log: Callable[[str], None], wake: threading.Event | None = None):
        self.args, self.model, self.index = args, model, index
        # A replica on GPUs sees its own alone: rank r is cuda:r there, as with one replica.
        self.env = env if gpus is None else {**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        self.gpus = gpus
        # Held until the group it was picked for is replaced: rank 0 binds it only once torch is imported.
        self.meeting: list[PortReservation] = []
        self.standby_meeting: list[PortReservation] = []  # in the standbys' command lines: the next group's
        self.workers = WorkerGroupSupervisor(self._start_workers,
                                             [f"127.0.0.1:{port}" for port in layout.worker_ports(args, index)],
                                             describe, failure, args.max_worker_restarts, args.step_timeout,
                                             log if args.data_parallel_size == 1 else
                                             lambda line: log(f"{line} (replica {index})"),
                                             self._start_standbys if args.standby_workers else None, wake)
        self.front: list[subprocess.Popen] = []

    @property
    def address(self) -> str:
        """Its scheduler's public gRPC address."""
        return f"{self.args.host}:{layout.scheduler_port(self.args, self.index)}"

    @property
    def gateway_url(self) -> str:
        return f"http://{layout.gateway_host(self.args)}:{layout.gateway_port(self.args, self.index)}"

    @property
    def procs(self) -> list[subprocess.Popen]:
        return self.workers.procs + self.front

    def start(self) -> None:
        self.workers.start()
        self.front = [Child(scheduler_command(self.args, self.index), self.env)]
        if self.args.openai_port:  # started now: it waits for the scheduler itself, and says so
            self.front.append(Child(gateway_command(self.args, self.index), self.env))

    def _start_workers(self, standbys: list[subprocess.Popen]) -> list[subprocess.Popen]:
        """The group: its standbys told to go on (they wait with its command lines), else fresh processes."""
        for held in self.meeting:
            held.release()
        if standbys and _told_to_go(standbys):
            self.meeting[:], self.standby_meeting[:] = self.standby_meeting, []
            return standbys
        self.workers.stop_standbys()
        self.meeting[:] = [PortReservation()]  # a fresh meeting point: the last group's may linger
        return self._start_ranks(self.env)

    def _start_standbys(self) -> list[subprocess.Popen]:
        for held in self.standby_meeting:
            held.release()
        self.standby_meeting[:] = [PortReservation()]
        return self._start_ranks({**self.env, STANDBY_ENV: "1"}, standby=True)

    def _start_ranks(self, env: dict[str, str], standby: bool = False) -> list[subprocess.Popen]:
        dist_init_addr = f"127.0.0.1:{(self.standby_meeting if standby else self.meeting)[0].port}"
        return [Child(worker_command(self.args, self.model, rank, dist_init_addr, self.index), env,
                      stdin=subprocess.PIPE if standby else None)
                for rank in range(self.args.tensor_parallel_size)]

    def release(self) -> None:
        """Stops watching the ranks and lets the meeting ports go (the processes are stopped elsewhere)."""
        self.workers.liveness.stop()
        for held in self.meeting + self.standby_meeting:
            held.release()


def _told_to_go(standbys: list[subprocess.Popen]) -> bool:
    """Writes GO to every standby; False if one is gone (the group then starts afresh)."""
    try:
        for proc in standbys:
            proc.stdin.write(GO)
            proc.stdin.flush()
    except OSError:
        return False
    return True
