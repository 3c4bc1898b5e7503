"""What a worker runs on, in one line: the torch build, its CUDA and the GPU. Logged at start-up and
reported at the handshake (WorkerInfo.platform, shown by `nanoserve info`), so a CUDA user sees which
build and card serve without opening a Python shell."""
import torch


def describe_platform(device: torch.device) -> str:
    """e.g. "torch 2.11.0+cu130, CUDA 13.0, NVIDIA H100 80GB HBM3 (compute capability 9.0)"."""
    if device.type != "cuda":
        return f"torch {torch.__version__}, CPU"
    major, minor = torch.cuda.get_device_capability(device)
    return (f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(device)} "
            f"(compute capability {major}.{minor})")
