"""Elementwise work that torch.compile fuses into single kernels on CUDA.

A decode step runs ~40 small elementwise kernels per layer; each costs a few microseconds even
inside a CUDA graph, so fusing them matters. On CPU (tests, CI) the plain functions run: no
compiler is needed and numerics stay the reference ones. The fused ops themselves live with their
concepts (norm, activation, sampler); rotary and Qwen3's q/k norm have a Triton kernel of their own.
"""
import functools
from typing import Callable

import torch

# Every (dtype, layout, size-1 batch) variant is one recompile; past the limit dynamo would quietly
# run the function uncompiled, and CUDA-graph replay (compiled at capture) would then disagree with
# eager steps. One worker sees a handful of variants; tests with several models see more.
RECOMPILE_LIMIT = 64


def configure_compiler() -> None:
    """The process-wide dynamo setting the fused ops need; idempotent, made before the first compile,
    never on import."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def fused_on_cuda(fn: Callable) -> Callable:
    """`fn`, compiled on the first CUDA call. torch.compile is only reached then: importing dynamo and
    inductor costs ~3 s of CPU, which a process that never computes on CUDA (a CPU worker, a test)
    does not pay."""
    @functools.cache
    def compiled() -> Callable:
        configure_compiler()
        return torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args):
        return compiled()(x, *args) if x.is_cuda else fn(x, *args)
    dispatch.compiled = compiled
    return dispatch
