"""A mixture-of-experts router's top-k in one Triton launch: per token, softmax over all experts in
float32, the top_k largest, renormalised to sum to 1 if asked (moe_reference.route, whose torch form is
a softmax, a topk and a division: three kernels and their intermediates). Experts are chosen by their
logits, which order them as the softmax does without its rounding; a program takes one token's row."""
import torch
import triton
import triton.language as tl


@triton.jit
def top_k_of_row(row_ptr, num_experts, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                 RENORMALIZE: tl.constexpr):
    """One token's (weights [BLOCK_K] float32, expert ids [BLOCK_K] int32) from its router logits at
    row_ptr; slots past TOP_K hold 0."""
    expert = tl.arange(0, BLOCK_E)
    logits = tl.load(row_ptr + expert, mask=expert < num_experts, other=float("-inf")).to(tl.float32)
    exp = tl.exp(logits - tl.max(logits, 0))
    probs = exp / tl.sum(exp, 0)
    slot = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(logits, 0).to(tl.int32)
        weights = tl.where(slot == k, tl.sum(tl.where(expert == best, probs, 0.0), 0), weights)
        ids = tl.where(slot == k, best, ids)
        logits = tl.where(expert == best, float("-inf"), logits)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    return weights, ids


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_logits,
                  TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    weights, ids = top_k_of_row(logits_ptr + row * stride_logits, num_experts, TOP_K, BLOCK_E, BLOCK_K, RENORMALIZE)
    slot = tl.arange(0, BLOCK_K)
    tl.store(weights_ptr + row * TOP_K + slot, weights, mask=slot < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slot, ids, mask=slot < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [tokens, experts] -> (weights float32, expert ids int32), each [tokens, top_k]."""
    tokens, experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens:
        _route_kernel[(tokens,)](router_logits, weights, ids, experts, router_logits.stride(0), TOP_K=top_k,
                                 BLOCK_E=triton.next_power_of_2(experts), BLOCK_K=triton.next_power_of_2(top_k),
                                 RENORMALIZE=renormalize, num_warps=1 if experts <= 128 else 4)
    return weights, ids
