"""Turns a validated step (StepWork columns) into the tensors the model and attention read.

This runs on the host before every step, so it never loops in Python: per-token columns come
from numpy ranges, block tables from one gather of the sequence table's rows. Host arrays go
through pinned memory so the copies to the device do not wait for the step before.
"""
from dataclasses import dataclass

import numpy as np
import torch

from kernels.backend import AttentionBackend
from model.sampler import SamplingRow
from worker_svc.context import StepContext
from worker_svc.seq_state import StepWork


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [N] every sequence's new tokens, packed
    positions: torch.Tensor        # [N]
    context: StepContext
    sample_indices: torch.Tensor   # [S] rows of the packed tokens whose next token is sampled
    sampled_slots: torch.Tensor    # [S] their sequences' slots (where the sampled tokens are kept)
    sampling: list[SamplingRow]    # [S]


def build_step_inputs(work: StepWork, block_tables: np.ndarray, block_size: int, backend: AttentionBackend,
                      last_tokens: torch.Tensor, decode_table_width: int = 0) -> StepInputs:
    """`block_tables` holds each slot's table; `last_tokens` each slot's last sampled token, fed in
    where an entry sends none. `decode_table_width` pads decode block tables to a fixed width, the
    CUDA graphs' own, so a decode computes the same numbers eager or replayed, whatever its
    batch-mates' lengths (a kernel such as flash-attn's picks its split of the context from the
    table width)."""
    device = last_tokens.device
    num_new, context_lens = work.num_new, work.context_lens
    cu_seqlens_q = np.concatenate(([0], np.cumsum(num_new)))
    is_prefill = bool((num_new != 1).any())  # decode kernels take exactly one query per sequence
    width = int(work.num_blocks.max())
    if not is_prefill:
        width = max(width, decode_table_width)
    tables = block_tables[work.slots, :width]
    # Each new token's position, then its slot through its own sequence's block table.
    seq_of_token = np.repeat(np.arange(len(num_new)), num_new)
    positions = np.arange(cu_seqlens_q[-1]) - cu_seqlens_q[seq_of_token] + (context_lens - num_new)[seq_of_token]
    slots = tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size

    def tensor(values, dtype: torch.dtype) -> torch.Tensor:
        host = torch.as_tensor(values, dtype=dtype)
        if device.type == "cuda":
            host = host.pin_memory()
        return host.to(device, non_blocking=True)

    input_ids = tensor(work.token_ids, torch.int64)
    if work.fed_rows:
        input_ids[tensor(work.fed_rows, torch.int64)] = last_tokens[tensor(work.fed_slots, torch.int64)]
    context = StepContext(backend=backend, is_prefill=is_prefill, slot_mapping=tensor(slots, torch.int64),
                          context_lens=tensor(context_lens, torch.int32),
                          block_tables=tensor(tables, torch.int32),
                          cu_seqlens_q=tensor(cu_seqlens_q, torch.int32))
    sampled = work.sampled
    return StepInputs(input_ids, tensor(positions, torch.int64), context,
                      tensor(cu_seqlens_q[1:][sampled] - 1, torch.int64),  # each sequence's last new token
                      tensor(work.slots[sampled], torch.int64), work.sampling)
