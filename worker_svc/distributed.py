"""Joins this worker process to its tensor-parallel group (NCCL on GPU, gloo on CPU), and leaves
the process when that group breaks."""
import logging
import os
import threading
import time
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from worker_svc.config import WorkerConfig
from worker_svc.group_network import StoreUnreachable, first_line, gloo_backend, use_socket_interfaces, wait_for_store

log = logging.getLogger("nanoserve.worker")

# How long ranks wait for each other: to meet at start-up (containers start at different times) and
# inside one collective. A peer that dies is noticed at once (its sockets close); this only bounds a
# peer that hangs, so it is long enough for a slow start and short enough to end a stuck service.
GROUP_TIMEOUT = timedelta(minutes=10)
# The heartbeat notices a dead peer while no step runs; a hung one within its timeout.
HEARTBEAT_SECONDS = 1.0
HEARTBEAT_TIMEOUT = timedelta(seconds=60)


class GroupError(Exception):
    """This rank cannot join its tensor-parallel group; the message says why."""


def uses_cuda(config: WorkerConfig) -> bool:
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def init_distributed(config: WorkerConfig) -> None:
    """Every rank blocks here until the whole group has met (world size 1 skips it); GroupError if
    it cannot."""
    if config.tensor_parallel_size == 1:
        return
    cuda = uses_cuda(config)
    if cuda:
        torch.cuda.set_device(config.rank % torch.cuda.device_count())
    use_socket_interfaces(config)
    gloo = gloo_backend(config)
    log.info("rank %d waiting for %d ranks at %s%s", config.rank, config.tensor_parallel_size,
             config.dist_init_addr, f" (its gloo sockets on {config.advertise_host})" if config.advertise_host else "")
    try:
        wait_for_store(config, GROUP_TIMEOUT)
        # device_id binds NCCL to this rank's GPU and sets its communicator up now, not inside
        # the first collective (which may be the one a CUDA graph is capturing).
        dist.init_process_group("nccl" if cuda else gloo, init_method=f"tcp://{config.dist_init_addr}",
                                rank=config.rank, world_size=config.tensor_parallel_size, timeout=GROUP_TIMEOUT,
                                device_id=torch.device("cuda", torch.cuda.current_device()) if cuda else None)
    except StoreUnreachable as err:
        raise GroupError(str(err)) from None
    except RuntimeError as err:  # torch.distributed's errors (DistError among them), a gloo device that cannot bind
        raise GroupError(f"the {config.tensor_parallel_size} ranks did not meet at "
                         f"{config.dist_init_addr}: {_why_not_met(err, cuda)}") from None
    _start_heartbeat(config.rank, gloo)
    log.info("rank %d joined its group", config.rank)


def all_ranks_agree(yes: bool, device: torch.device) -> bool:
    """True where every rank of the group says yes (one all-reduce, on `device` as the group's backend
    needs): for choices that decide which collectives a rank runs next."""
    flag = torch.tensor([int(yes)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _why_not_met(err: Exception, cuda: bool) -> str:
    """NCCL's reason; for ranks on one GPU (more ranks on a host than the GPUs it shows them), what to
    change, in one line instead of NCCL's several."""
    if not (cuda and "Duplicate GPU" in str(err)):
        return first_line(err)
    count = torch.cuda.device_count()
    return (f"its GPU (cuda:{torch.cuda.current_device()}) is another rank's too, and NCCL needs a GPU for each rank: "
            f"this process sees {count} GPU{'s' if count != 1 else ''} (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); run at most {count} rank{'s' if count != 1 else ''} "
            "on this host (--tensor-parallel-size), or give each rank its own GPU")


def _start_heartbeat(rank: int, gloo: str) -> None:
    """A rank learns that a peer died only in its next collective, which may never come: the scheduler
    stops stepping a group it saw lose a rank, and a restarted peer would join this rank's stale
    rendezvous and look whole. So a barrier on a side group (gloo, apart from the steps' collectives)
    runs every second, and the rank exits when it fails; restarted, all ranks meet afresh."""
    group = dist.new_group(backend=gloo, timeout=HEARTBEAT_TIMEOUT)

    def beat() -> None:
        while True:
            try:
                dist.barrier(group=group)
            except RuntimeError as err:
                exit_broken_rank(f"rank {rank} lost a peer of its tensor-parallel group: {first_line(err)}")
            time.sleep(HEARTBEAT_SECONDS)

    threading.Thread(target=beat, name="tp-heartbeat", daemon=True).start()


def exit_broken_rank(reason: str) -> NoReturn:
    """Ends the process at once: a broken process group (or device) cannot be repaired in place, so
    the rank must stop serving and be restarted. os._exit, because a normal exit would tear down the
    process group and may block on the dead peer, and sys.exit only ends the calling thread."""
    log.critical("%s; exiting", reason)
    logging.shutdown()
    os._exit(1)
