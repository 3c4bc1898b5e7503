"""Where `nanoserve up`'s processes go: each replica's ports and GPUs, the router's ports.

Replica d (of --data-parallel-size N) serves its gRPC API on --port + d, its worker ranks on
--worker-base-port + d x --tensor-parallel-size + rank, and takes the d-th block of
--tensor-parallel-size visible GPUs (CUDA_VISIBLE_DEVICES narrowed to them, so each rank's device
index is its rank, as with one replica). One replica serves its gateway on --openai-port itself;
with more, the SMG router takes --openai-port, replica d's gateway 127.0.0.1:--openai-port + 1 + d,
and the router's metrics the port after the last gateway's.
"""
import subprocess
from argparse import Namespace
from collections.abc import Mapping


class TooFewGPUs(Exception):
    """The replicas need more GPUs than are visible; the message says how many of each, in one line."""


def scheduler_port(args: Namespace, replica: int) -> int:
    return args.port + replica


def worker_ports(args: Namespace, replica: int) -> list[int]:
    first = args.worker_base_port + replica * args.tensor_parallel_size
    return [first + rank for rank in range(args.tensor_parallel_size)]


def gateway_host(args: Namespace) -> str:
    """Where the replicas' gateways listen: --host, or loopback behind the router."""
    return args.host if args.data_parallel_size == 1 else "127.0.0.1"


def gateway_port(args: Namespace, replica: int) -> int:
    """Replica `replica`'s OpenAI gateway; 0 when it runs none."""
    if not args.openai_port:
        return 0
    return args.openai_port if args.data_parallel_size == 1 else args.openai_port + 1 + replica


def router_metrics_port(args: Namespace) -> int:
    return args.openai_port + 1 + args.data_parallel_size


def metrics_port(args: Namespace, replica: int) -> int:
    """Replica `replica`'s scheduler metrics port; 0 when off."""
    return args.metrics_port + replica if args.metrics_port else 0


def visible_gpus(device: str, environ: Mapping[str, str]) -> list[str]:
    """The GPUs the workers would see (CUDA_VISIBLE_DEVICES, else the driver's list); none on CPU.
    Asked without torch: the launcher does not import it."""
    if device == "cpu":
        return []
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [gpu.strip() for gpu in environ["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # no driver: CPU
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()] if listed.returncode == 0 else []


def replica_gpus(gpus: list[str], data_parallel_size: int, tensor_parallel_size: int) -> list[list[str]] | None:
    """Each replica's GPUs, in order; None on CPU (no GPU visible: any number of replicas fits)."""
    if not gpus:
        return None
    needed = data_parallel_size * tensor_parallel_size
    if needed > len(gpus):
        raise TooFewGPUs(f"--data-parallel-size {data_parallel_size} x --tensor-parallel-size {tensor_parallel_size} "
                         f"needs {needed} GPUs, and {len(gpus)} are visible ({','.join(gpus)}): lower either "
                         "size, or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    return [gpus[d * tensor_parallel_size:(d + 1) * tensor_parallel_size] for d in range(data_parallel_size)]
