"""The one folder where nanoserve keeps what it builds or fetches once: the demo and benchmark
models, the Qwen3 tokenizer files and the workers' compiled kernels. $NANOSERVE_CACHE, else
~/.cache/nanoserve."""
import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("NANOSERVE_CACHE") or Path.home() / ".cache" / "nanoserve")


def demo_model_dir(tied: bool = False) -> Path:
    """The tiny demo model that `nanoserve up` serves without --model (tests build a tied one too)."""
    return cache_dir() / ("tiny-qwen3-tied" if tied else "tiny-qwen3")


def bench_model_dir() -> Path:
    """The Qwen3-0.6B-shaped benchmark model (random weights)."""
    return cache_dir() / "qwen3-0.6b-random"


def compile_caches() -> dict[str, str]:
    """Where `up`'s workers keep Triton's compiled kernels (unless the environment says): here rather
    than in /tmp, so that a restarted worker, or a container whose cache is a volume, loads them
    instead of compiling again."""
    return {"TRITON_CACHE_DIR": str(cache_dir() / "triton")}
