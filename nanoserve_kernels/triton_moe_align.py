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
and labels the blocks; one program per expert writes its pairs' positions. A decode step's few pairs
take one launch instead, the router's top-k included (route_and_align).
"""
import torch
import triton
import triton.language as tl

from nanoserve.mathutil import cdiv
from nanoserve_kernels.triton_moe_routing import top_k_of_row

SCAN = 1024  # pairs a program reads at a time
SMALL_PAIRS = 256  # steps of at most this many pairs route and sort in one launch (route_and_align)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, SCAN: tl.constexpr):
    expert = tl.program_id(0)
    count = tl.zeros([SCAN], tl.int32)
    for start in range(0, num_pairs, SCAN):
        pair = start + tl.arange(0, SCAN)
        count += (tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1) == expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(count, 0))


@triton.jit
def _label_blocks(ends, total, block_experts_ptr, BLOCK_M: tl.constexpr, SCAN: tl.constexpr):
    """Block b of the `total` padded rows belongs to the first expert whose run `ends` after its first row."""
    for start in range(0, total // BLOCK_M, SCAN):
        block = start + tl.arange(0, SCAN)
        owner = tl.sum((ends[None, :] <= block[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(block_experts_ptr + block, owner, mask=block < total // BLOCK_M)


@triton.jit
def _offsets_kernel(counts_ptr, starts_ptr, block_experts_ptr, num_padded_ptr, num_experts,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, SCAN: tl.constexpr):
    expert = tl.arange(0, BLOCK_E)
    padded = tl.cdiv(tl.load(counts_ptr + expert, mask=expert < num_experts, other=0), BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + expert, ends - padded, mask=expert < num_experts)
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    _label_blocks(ends, total, block_experts_ptr, BLOCK_M, SCAN)


@triton.jit
def _place_kernel(ids_ptr, starts_ptr, sorted_pairs_ptr, num_pairs, SCAN: tl.constexpr):
    expert = tl.program_id(0)
    position = tl.load(starts_ptr + expert)
    for start in range(0, num_pairs, SCAN):
        pair = start + tl.arange(0, SCAN)
        mine = (tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1) == expert).to(tl.int32)
        tl.store(sorted_pairs_ptr + position + tl.cumsum(mine, 0) - 1, pair, mask=mine == 1)
        position += tl.sum(mine, 0)


@triton.jit
def _route_and_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
                            tokens, num_experts, stride_logits, max_rows, TOP_K: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                            BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, SCAN: tl.constexpr):
    num_pairs = tokens * TOP_K
    slot = tl.arange(0, BLOCK_K)
    for token in range(0, tokens):
        weights, ids = top_k_of_row(logits_ptr + token * stride_logits, num_experts, TOP_K, BLOCK_E,
                                    BLOCK_K, RENORMALIZE)
        tl.store(weights_ptr + token * TOP_K + slot, weights, mask=slot < TOP_K)
        tl.store(ids_ptr + token * TOP_K + slot, ids, mask=slot < TOP_K)
    for start in range(0, max_rows, SCAN):  # padding names no pair
        row = start + tl.arange(0, SCAN)
        tl.store(sorted_pairs_ptr + row, num_pairs, mask=row < max_rows)
    tl.debug_barrier()  # the ids and the padding are in memory before any thread reads or overwrites them
    pair = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
    expert = tl.arange(0, BLOCK_E)
    padded = tl.cdiv(tl.sum((ids[None, :] == expert[:, None]).to(tl.int32), 1), BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    _label_blocks(ends, total, block_experts_ptr, BLOCK_M, SCAN)
    # A pair's row: its expert's first row plus the pairs of that expert before it.
    first_row = tl.sum(tl.where(ids[:, None] == expert[None, :], (ends - padded)[None, :], 0), 1)
    before = tl.sum(((ids[None, :] == ids[:, None]) & (pair[None, :] < pair[:, None])).to(tl.int32), 1)
    tl.store(sorted_pairs_ptr + first_row + before, pair, mask=pair < num_pairs)


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


def route_and_align(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For steps of at most SMALL_PAIRS pairs (decode), the router's top-k (triton_moe_routing.route) and
    the sort-and-pad in one launch of one program, where the separate kernels take five (the padding's
    fill among them) and a decode step pays a few microseconds for each: (weights, ids, (sorted_pairs,
    block_experts, num_padded)), the same values as route() then align_block_size()."""
    tokens, num_experts = router_logits.shape
    num_pairs, device = tokens * top_k, router_logits.device
    assert num_pairs <= SMALL_PAIRS and router_logits.stride(1) == 1
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_experts = torch.empty(cdiv(max_rows, block_m), dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _route_and_align_kernel[(1,)](router_logits, weights, ids, sorted_pairs, block_experts, num_padded, tokens,
                                  num_experts, router_logits.stride(0), max_rows, TOP_K=top_k,
                                  BLOCK_E=triton.next_power_of_2(num_experts),
                                  BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                                  BLOCK_P=triton.next_power_of_2(num_pairs), BLOCK_M=block_m, SCAN=64, num_warps=4)
    return weights, ids, (sorted_pairs, block_experts, num_padded)
