"""Sort-and-pad of a step's (token, expert) pairs for the grouped GEMMs (triton_moe_gemm.py): the pairs
grouped by expert, each expert's run padded to a whole number of BLOCK_M rows, so that every block of
rows the GEMM takes belongs to one expert and reads that expert's weights alone.

A pair is its index in the flattened [tokens, top_k] expert ids (token = pair // top_k). Outputs:
  sorted_pairs [max_padded] int32: pairs in expert order; padding holds `num_pairs` (no pair)
  block_experts [max_blocks] int32: the expert of each BLOCK_M rows of sorted_pairs
  num_padded [1] int32: rows of sorted_pairs in use (a multiple of BLOCK_M)
Their sizes are static upper bounds, num_pairs + min(experts, num_pairs) * (BLOCK_M - 1) rows, known
from the token count alone, and nothing is read back to the host: a decode step's graph replays it
whatever the routing. The GEMMs launch for max_blocks and skip the blocks past num_padded.

Three launches, without atomics, so the order is stable (pairs of an expert in token order, the same
every run): one program per expert counts its pairs; one program turns the counts into padded offsets
and labels the blocks; one program per expert writes its pairs' positions.
"""
import torch
import triton
import triton.language as tl

from nanoserve.mathutil import cdiv

SCAN = 1024  # pairs a program reads at a time


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, SCAN: tl.constexpr):
    expert = tl.program_id(0)
    count = tl.zeros([SCAN], tl.int32)
    for start in range(0, num_pairs, SCAN):
        pair = start + tl.arange(0, SCAN)
        count += (tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1) == expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(count, 0))


@triton.jit
def _offsets_kernel(counts_ptr, starts_ptr, block_experts_ptr, num_padded_ptr, num_experts,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, SCAN: tl.constexpr):
    expert = tl.arange(0, BLOCK_E)
    padded = tl.cdiv(tl.load(counts_ptr + expert, mask=expert < num_experts, other=0), BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + expert, ends - padded, mask=expert < num_experts)
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    # Block b belongs to the first expert whose run ends after its first row.
    for start in range(0, total // BLOCK_M, SCAN):
        block = start + tl.arange(0, SCAN)
        owner = tl.sum((ends[None, :] <= block[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(block_experts_ptr + block, owner, mask=block < total // BLOCK_M)


@triton.jit
def _place_kernel(ids_ptr, starts_ptr, sorted_pairs_ptr, num_pairs, SCAN: tl.constexpr):
    expert = tl.program_id(0)
    position = tl.load(starts_ptr + expert)
    for start in range(0, num_pairs, SCAN):
        pair = start + tl.arange(0, SCAN)
        mine = (tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1) == expert).to(tl.int32)
        tl.store(sorted_pairs_ptr + position + tl.cumsum(mine, 0) - 1, pair, mask=mine == 1)
        position += tl.sum(mine, 0)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows sort-and-pad can fill: each expert that has pairs pads its run by < BLOCK_M."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [tokens, top_k] int32 -> (sorted_pairs, block_experts, num_padded), as the module says."""
    num_pairs, device = ids.numel(), ids.device
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    block_experts = torch.empty(cdiv(max_rows, block_m), dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    _count_kernel[(num_experts,)](ids, counts, num_pairs, SCAN=SCAN)
    _offsets_kernel[(1,)](counts, starts, block_experts, num_padded, num_experts, BLOCK_M=block_m,
                          BLOCK_E=triton.next_power_of_2(num_experts), SCAN=64)
    _place_kernel[(num_experts,)](ids, starts, sorted_pairs, num_pairs, SCAN=SCAN)
    return sorted_pairs, block_experts, num_padded
