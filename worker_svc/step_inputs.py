"""Turns a validated step (SeqWork entries) into the tensors the model and attention read."""
from dataclasses import dataclass

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
    input_ids, positions, slots, cu_seqlens_q = [], [], [], [0]
    sample_indices, sampling = [], []
    for seq in work:
        new_positions = range(seq.num_computed, seq.context_len)
        input_ids += seq.token_ids
        positions += new_positions
        slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in new_positions]
        cu_seqlens_q.append(cu_seqlens_q[-1] + len(seq.token_ids))
        if seq.sampling is not None:
            sample_indices.append(cu_seqlens_q[-1] - 1)  # the sequence's last new token
            sampling.append(seq.sampling)
    is_prefill = any(len(seq.token_ids) != 1 for seq in work)
    width = max(len(seq.block_table) for seq in work)
    if not is_prefill:
        width = max(width, decode_table_width)
    block_tables = [list(seq.block_table) + [-1] * (width - len(seq.block_table)) for seq in work]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    context = StepContext(
        backend=backend,
        # Decode kernels take one query per sequence; any longer entry makes the step a prefill.
        is_prefill=is_prefill,
        slot_mapping=tensor(slots, torch.int64),
        context_lens=tensor([seq.context_len for seq in work], torch.int32),
        block_tables=tensor(block_tables, torch.int32),
        cu_seqlens_q=tensor(cu_seqlens_q, torch.int32),
    )
    return StepInputs(tensor(input_ids, torch.int64), tensor(positions, torch.int64), context,
                      tensor(sample_indices, torch.int64), sampling)
