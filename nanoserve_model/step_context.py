"""What the attention layers need to know about the current step, set by the worker around each
forward pass (the model's forward signature stays input_ids, positions).

The worker builds the step on the host, so it knows the step's lengths there: they travel here as
Python ints beside the device tensors, and no kernel wrapper reads a length back from the device.
"""
import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from nanoserve_kernels.backend import AttentionBackend


@dataclass
class StepContext:
    """Tensor shapes and meanings as in nanoserve_kernels.reference."""
    backend: AttentionBackend
    is_prefill: bool             # False: every sequence computes exactly one token (paged_decode)
    slot_mapping: torch.Tensor   # [num_tokens]
    context_lens: torch.Tensor   # [num_seqs] int32 (what paged_decode reads)
    block_tables: torch.Tensor   # [num_seqs, max_blocks]
    # Over the sequences that attend as a prefill: all of them, or those after num_decodes.
    cu_seqlens_q: torch.Tensor   # [num_seqs - num_decodes + 1] int32
    cu_seqlens_k: torch.Tensor   # [num_seqs - num_decodes + 1] int32, prefix sums of their context_lens
    # Longest new-token run and longest context of those sequences (paged_prefill's grid). Decode
    # steps carry bounds instead (1 and the model length limit): a CUDA graph replays one context for
    # every step of its batch size, so nothing in it may depend on one step's lengths.
    max_seqlen_q: int
    max_seqlen_k: int
    # A mixed prefill step (decodes beside prompt chunks) starts with this many sequences of one new
    # token each, whose queries attend through paged_decode (context_lens, block_tables: their rows).
    num_decodes: int = 0
    # The decoding sequences' rows (all of a decode step's, a mixed step's leading ones), longest
    # context first: the order the decode kernel starts them in (None: row order).
    decode_order: torch.Tensor | None = None  # [num_seqs or num_decodes] int32
    # Set while a piecewise CUDA graph is captured (worker_svc.prefill_graphs): each attention
    # layer, once it has stored the step's K/V, hands its queries [N, heads, head_dim] to the cut
    # instead of attending, and goes on with the [N, heads, head_dim] tensor it returns, which
    # holds the layer's attention output when the graph is replayed.
    attention_cut: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None  # (the Attention layer, q)
    # With a cut: the static buffer [max tokens, heads, head_dim] the cut reads queries from, where the
    # layers' rotary writes them (Attention.query_buffer), so the cut has nothing to copy.
    attention_queries: torch.Tensor | None = None


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
