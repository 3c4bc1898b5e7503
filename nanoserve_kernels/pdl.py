"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A kernel launched with PDL may be placed on the GPU while the kernel before it in the stream still
runs. It must then wait (griddepcontrol.wait) before it touches memory that kernel, or any before
it, writes or reads: its outputs too, whose buffers the caching allocator recycles. Only inputs
that no kernel writes while serving (the weights) may be loaded before the wait. Right after its
wait a program lets the next kernel be placed (griddepcontrol.launch_dependents), so at most two
kernels are resident at a time and the chain of waits stays ordered: every program waits before
it can end, so a kernel never completes before the one it follows.

At batch 1 a decode step is ~250 kernels of a few microseconds, each of which starts cold: the
launch, then the first loads' trip to memory. With PDL the next kernel is already resident when
one ends, and the matrix-vector kernels have their first weight tiles in registers by then.

NANOSERVE_PDL=0 turns it off (for A/B measurements); the CPU interpreter cannot run the
instructions, so it is off there too.
"""
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def pdl_on(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: Hopper or later, not interpreted, not turned off."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("NANOSERVE_PDL") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """The kernel arguments of a launch on `device`: the PDL constexpr and Triton's launch option."""
    on = pdl_on(device)
    return dict(PDL=on, launch_pdl=True) if on else dict(PDL=False)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Where a PDL program starts touching memory other kernels share (see the module docstring)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
