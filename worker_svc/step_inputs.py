"""Turns a validated step (SeqWork entries) into the tensors the model and attention read.

This runs on the host before every step, so it loops over sequences, never over tokens or table
entries in Python: per-token columns come from numpy ranges, block tables from row copies.
"""
from dataclasses import dataclass

import numpy as np
import torch

from kernels.backend import AttentionBackend
from model.sampler import SamplingRow
from worker_svc.context import StepContext
from worker_svc.seq_state import SeqWork


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # [N] every sequence's new tokens, packed
    positions: torch.Tensor        # [N]
    context: StepContext
    sample_indices: torch.Tensor   # [S] rows of the packed tokens whose next token is sampled
    sampling: list[SamplingRow]    # [S]


def build_step_inputs(work: list[SeqWork], block_size: int, backend: AttentionBackend,
                      device: torch.device, decode_table_width: int = 0) -> StepInputs:
    """`decode_table_width` pads decode block tables to a fixed width, the CUDA graphs' own, so a
    decode computes the same numbers eager or replayed, whatever its batch-mates' lengths (a kernel
    such as flash-attn's picks its split of the context from the table width)."""
    num_new = np.fromiter((len(seq.token_ids) for seq in work), np.int64, len(work))
    context_lens = np.fromiter((seq.context_len for seq in work), np.int64, len(work))
    cu_seqlens_q = np.concatenate(([0], np.cumsum(num_new)))
    is_prefill = bool((num_new != 1).any())  # decode kernels take exactly one query per sequence
    width = max(len(seq.block_table) for seq in work)
    if not is_prefill:
        width = max(width, decode_table_width)
    block_tables = np.full((len(work), width), -1, np.int64)
    for row, seq in zip(block_tables, work):
        row[: len(seq.block_table)] = seq.block_table
    # Each new token's position, then its slot through its own sequence's block table.
    seq_of_token = np.repeat(np.arange(len(work)), num_new)
    positions = np.arange(cu_seqlens_q[-1]) - cu_seqlens_q[seq_of_token] + (context_lens - num_new)[seq_of_token]
    slots = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    input_ids = [token for seq in work for token in seq.token_ids]
    sampled = [i for i, seq in enumerate(work) if seq.sampling is not None]

    def tensor(values, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)

    context = StepContext(backend=backend, is_prefill=is_prefill, slot_mapping=tensor(slots, torch.int64),
                          context_lens=tensor(context_lens, torch.int32),
                          block_tables=tensor(block_tables, torch.int32),
                          cu_seqlens_q=tensor(cu_seqlens_q, torch.int32))
    return StepInputs(tensor(input_ids, torch.int64), tensor(positions, torch.int64), context,
                      tensor(cu_seqlens_q[1:][sampled] - 1, torch.int64),  # each sequence's last new token
                      [work[i].sampling for i in sampled])
