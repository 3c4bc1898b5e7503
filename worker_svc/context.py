"""What the attention layers need to know about the current step, set by the runner around each
forward pass (the model's forward signature stays input_ids, positions)."""
import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from kernels.backend import AttentionBackend


@dataclass
class StepContext:
    """Tensor shapes as in kernels.reference."""
    backend: AttentionBackend
    is_prefill: bool             # False: every sequence computes exactly one token (paged_decode)
    slot_mapping: torch.Tensor   # [num_tokens]
    context_lens: torch.Tensor   # [num_seqs]
    block_tables: torch.Tensor   # [num_seqs, max_blocks]
    cu_seqlens_q: torch.Tensor   # [num_seqs + 1]


_current: StepContext | None = None


@contextlib.contextmanager
def step_context(context: StepContext) -> Iterator[StepContext]:
    global _current
    _current = context
    try:
        yield context
    finally:
        _current = None


def get_step_context() -> StepContext:
    if _current is None:
        raise RuntimeError("attention ran outside a step: wrap the forward pass in step_context()")
    return _current
