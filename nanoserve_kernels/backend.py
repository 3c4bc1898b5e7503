"""Attention backends: three functions with the signatures of nanoserve_kernels.reference (store_kvcache,
paged_prefill, paged_decode), looked up by name so each implementation plugs in alone."""
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

TRITON_STORE = "nanoserve_kernels.triton_kv_store:store_kvcache"
# name -> "module:function" for store_kvcache, paged_prefill, paged_decode
BACKENDS: dict[str, tuple[str, str, str]] = {
    "torch": ("nanoserve_kernels.reference:store_kvcache", "nanoserve_kernels.reference:paged_prefill",
              "nanoserve_kernels.reference:paged_decode"),
    "triton": (TRITON_STORE, "nanoserve_kernels.triton_prefill:paged_prefill",
               "nanoserve_kernels.triton_decode:paged_decode"),
    "flash-attn": (TRITON_STORE,
                   "nanoserve_kernels.flash_attn_backend:paged_prefill",
                   "nanoserve_kernels.flash_attn_backend:paged_decode"),
}
FLASH_ATTN_BLOCK_MULTIPLE = 256  # flash-attn's paged kernels need blocks of a multiple of 256 tokens
FLASH_ATTN_NO_FP8 = ("the flash-attn backend cannot read an FP8 KV cache (--kv-cache-dtype fp8): use "
                     "--attention-backend triton, or auto")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kvcache: Callable
    paged_prefill: Callable
    paged_decode: Callable

    @property
    def graph_safe(self) -> bool:
        """Whether its store and decode can be captured in a CUDA graph: the torch reference reads
        lengths back to the host and indexes by masks, which a capture forbids."""
        return self.name != "torch"

    @property
    def decode_quantizes(self) -> bool:
        """Whether its decode can write its output quantized for the o projection's W8A8 GEMM (the Triton
        kernel's `quantized_out`): one activation pass fewer a layer."""
        return self.name == "triton"

    @property
    def stores_with_triton(self) -> bool:
        """Whether its store is the Triton kernel, whose work the rotary kernel can do instead as it
        makes k (CacheWrite): one launch fewer a layer."""
        return BACKENDS[self.name][0] == TRITON_STORE


@dataclass(frozen=True)
class CacheWrite:
    """A store_kvcache call but its k, handed to the kernel that makes k so that it stores k and v
    itself (nanoserve_kernels.triton_rotary); defined here, apart from the kernels, for the model to
    name without importing Triton."""
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def _function(target: str) -> Callable:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def auto_backend_name(device: str, block_size: int, fp8_kv: bool = False) -> str:
    """flash-attn where it is installed, the block size suits it and the KV cache is not FP8 (which
    it cannot read), then our Triton kernels on CUDA, else the plain torch reference."""
    if device != "cuda":
        return "torch"
    if not fp8_kv and importlib.util.find_spec("flash_attn") and block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0:
        return "flash-attn"
    return "triton"


def select_backend(name: str, device: str, block_size: int, fp8_kv: bool = False) -> AttentionBackend:
    """The backend called `name` ("auto" picks one for the device and KV dtype); ValueError if it
    cannot run."""
    if name == "auto":
        name = auto_backend_name(device, block_size, fp8_kv)
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}: expected auto or one of {', '.join(BACKENDS)}")
    if name == "flash-attn" and fp8_kv:
        raise ValueError(FLASH_ATTN_NO_FP8)
    if name == "flash-attn" and block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        raise ValueError(f"the flash-attn backend needs a block size that is a multiple of "
                         f"{FLASH_ATTN_BLOCK_MULTIPLE}, got {block_size}")
    return AttentionBackend(name, *(_function(target) for target in BACKENDS[name]))
