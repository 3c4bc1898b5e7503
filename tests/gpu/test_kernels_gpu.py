"""The Triton kernels, and the flash-attn backend when flash_attn imports, vs the torch reference
on CUDA at the benchmark model's sizes (16 query heads, 8 KV heads, head_dim 128, Qwen3's
vocabulary) in bf16, over bf16 and FP8 caches (the FP8 store bit for bit: same e4m3 codes and
scales as the reference)."""
import dataclasses

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from nanoserve_kernels import flash_attn_backend, race_sampling, triton_decode  # noqa: E402
from nanoserve_kernels import triton_kv_store, triton_prefill, triton_rotary, triton_sampling  # noqa: E402
from nanoserve_kernels import triton_token_bitmask  # noqa: E402
from nanoserve_kernels.token_bitmask import TokenMasks, bitmask_words  # noqa: E402
from nanoserve_model import qwen3  # noqa: E402
from tests.worker.test_triton_kernels import (  # noqa: E402
    Case, check_decode, check_fused_gemv, check_gate_up_silu, check_prefill, check_rotary, check_rotary_store,
    check_sampling, check_silu_and_mul, check_store, check_token_bitmask, make_paged_batch)

BF16 = dict(head_dim=128, dtype=torch.bfloat16)
STORE_CASES = [Case(new_lens=(700,), context_lens=(1500,), heads=16, kv_heads=8, block_size=256, **BF16),
               Case(new_lens=(700,), context_lens=(1500,), heads=16, kv_heads=8, block_size=256, fp8=True, **BF16)]
PREFILL_CASES = [
    # first prefills, GQA 2
    Case(new_lens=(1024, 517, 33), context_lens=(1024, 517, 33), heads=16, kv_heads=8,
         block_size=256, **BF16),
    # prefix-cache hits, GQA 2
    Case(new_lens=(1024, 100), context_lens=(2048, 612), heads=16, kv_heads=8, block_size=256, **BF16),
    # chunked prefill continuing mid-block, GQA 8
    Case(new_lens=(512, 300), context_lens=(1536, 701), heads=16, kv_heads=2, block_size=16, **BF16),
    # long prompts (the long-prompt tiles), first and over a cached prefix, GQA 4 as Qwen3-8B's
    Case(new_lens=(4000, 100), context_lens=(4000, 100), heads=32, kv_heads=8, block_size=256, **BF16),
    Case(new_lens=(2048,), context_lens=(3000,), heads=32, kv_heads=8, block_size=256, **BF16),
    # GQA 1, other power-of-two head_dims
    Case(new_lens=(200, 77), context_lens=(200, 300), heads=8, kv_heads=8, head_dim=64,
         block_size=32, dtype=torch.bfloat16),
    Case(new_lens=(150, 9), context_lens=(300, 9), heads=4, kv_heads=4, head_dim=256,
         block_size=16, dtype=torch.bfloat16),
    # FP8 cache: prefix hits at the benchmark shape; chunked, GQA 8, small blocks
    Case(new_lens=(1024, 100), context_lens=(2048, 612), heads=16, kv_heads=8, block_size=256, fp8=True, **BF16),
    Case(new_lens=(512, 300), context_lens=(1536, 701), heads=16, kv_heads=2, block_size=16, fp8=True, **BF16),
]
_LENGTHS = torch.randint(0, 2048, (64,), generator=torch.Generator().manual_seed(0)).tolist()
DECODE_CASES = [
    # many sequences (no split), GQA 2, a few padding rows of length 0
    Case(new_lens=(1,) * 64, context_lens=tuple(_LENGTHS[:60]) + (0,) * 4, heads=16, kv_heads=8,
         block_size=256, **BF16),
    # few sequences: split along the context
    Case(new_lens=(1,) * 3, context_lens=(4000, 0, 77), heads=16, kv_heads=8, block_size=256, **BF16),
    # GQA 8
    Case(new_lens=(1,) * 7, context_lens=(1, 16, 17, 300, 999, 1024, 2500), heads=16, kv_heads=2,
         block_size=16, **BF16),
    # GQA 1, other power-of-two head_dims
    Case(new_lens=(1,) * 5, context_lens=(5, 50, 500, 0, 1234), heads=8, kv_heads=8, head_dim=64,
         block_size=32, dtype=torch.bfloat16),
    Case(new_lens=(1,) * 2, context_lens=(700, 33), heads=4, kv_heads=4, head_dim=256,
         block_size=16, dtype=torch.bfloat16),
    # FP8 cache: many sequences with padding rows; few, split; GQA 8
    Case(new_lens=(1,) * 64, context_lens=tuple(_LENGTHS[:60]) + (0,) * 4, heads=16, kv_heads=8,
         block_size=256, fp8=True, **BF16),
    Case(new_lens=(1,) * 3, context_lens=(4000, 0, 77), heads=16, kv_heads=8, block_size=256, fp8=True, **BF16),
    Case(new_lens=(1,) * 7, context_lens=(1, 16, 17, 300, 999, 1024, 2500), heads=16, kv_heads=2,
         block_size=16, fp8=True, **BF16),
]
needs_flash_attn = pytest.mark.skipif(not flash_attn_backend.AVAILABLE, reason="flash_attn not importable")



def flash_attn_shaped(cases: list[Case]) -> list[Case]:
    """The minimal flash-attn build serves bf16, head_dim 128, blocks of a multiple of 256; no FP8."""
    return [c for c in cases if c.head_dim == 128 and c.block_size % 256 == 0 and not c.fp8]


@pytest.mark.parametrize("case", STORE_CASES)
def test_triton_store(case: Case) -> None:
    check_store(triton_kv_store.store_kvcache, case, "cuda", seed=0)


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_triton_prefill(case: Case) -> None:
    check_prefill(triton_prefill.paged_prefill, case, "cuda", seed=1)


@pytest.mark.parametrize("case", DECODE_CASES)
def test_triton_decode(case: Case) -> None:
    check_decode(triton_decode.paged_decode, case, "cuda", seed=2)


def test_triton_decode_replays_in_cuda_graph() -> None:
    """Captured once at capacity with a dispatch order, as the worker's graphs are, then replayed over
    other lengths, block tables and orders written into the captured buffers: right every time, since
    the launch depends only on shapes."""
    capacity = Case(new_lens=(1,) * 3, context_lens=(4000,) * 3, heads=16, kv_heads=8,
                    block_size=256, **BF16)
    static = make_paged_batch(capacity, "cuda", seed=5).decode_args()
    block_tables = static[-1]
    static_order = torch.arange(3, dtype=torch.int32, device="cuda")
    scale = capacity.head_dim ** -0.5
    triton_decode.paged_decode(*static, scale, order=static_order)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_decode.paged_decode(*static, scale, order=static_order)

    def replay(*step: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
        block_tables.fill_(-1)
        for buffer, new in zip(static, step[:-1]):
            buffer[tuple(slice(0, n) for n in new.shape)].copy_(new)
        static_order.copy_(torch.arange(3, dtype=torch.int32) if order is None else order)
        graph.replay()
        return out.clone()

    for seed, lengths in enumerate([(10, 3000, 0), (4000, 1, 77)]):
        check_decode(replay, dataclasses.replace(capacity, context_lens=lengths), "cuda", seed)


def test_triton_rotary() -> None:
    check_rotary(triton_rotary.rotate_qk_, "cuda", (torch.float32, torch.bfloat16))


@pytest.mark.parametrize("case", STORE_CASES)
def test_triton_rotary_with_the_cache_write(case: Case) -> None:
    check_rotary_store(triton_rotary.rotate_qk_, triton_kv_store.store_kvcache, case, "cuda", seed=3)


def test_qwen3_qk_norm_rotary_on_cuda_agrees_with_the_cpu_path() -> None:
    """Qwen3-sized bf16 q/k: the kernel (CUDA) and the plain functions (CPU) round alike: nearly every
    element equal, the rest one bf16 step apart (float32 sums and cos/sin differ in their last bits)."""
    gen = torch.Generator("cuda").manual_seed(0)
    q, k = (torch.randn(300, heads, 128, generator=gen, device="cuda").bfloat16() for heads in (16, 8))
    q_weight, k_weight = (1 + 0.3 * torch.randn(2, 128, generator=gen, device="cuda")).bfloat16().unbind(0)
    angles = torch.outer(torch.arange(4096.0), 1e6 ** -(torch.arange(0, 128, 2) / 128)).cuda()
    positions = torch.randint(0, 4096, (300,), generator=gen, device="cuda")
    args = (q_weight, k_weight, 1e-6, angles.cos(), angles.sin(), positions)
    expected = qwen3.qk_norm_rotary(q.cpu(), k.cpu(), *(a.cpu() if torch.is_tensor(a) else a for a in args))
    got = qwen3.qk_norm_rotary(q, k, *args)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.cpu(), e, rtol=2**-7, atol=2**-6)
        assert (g.cpu() == e).float().mean() > 0.98


def test_triton_sampling() -> None:
    check_sampling(triton_sampling.race_sample, "cuda")


def test_triton_token_bitmask() -> None:
    check_token_bitmask(triton_token_bitmask.apply_token_bitmask, "cuda")


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_triton_sampling_of_bf16_logits_matches_the_cpu_reference(rows: int) -> None:
    """Qwen3-sized bf16 logits, half the rows greedy: the same tokens as the plain-torch race on the
    CPU (the noise is counter-based; only float rounding could part them, at an exact near-tie), with
    grammar masks or without."""
    gen = torch.Generator("cuda").manual_seed(rows)
    logits = (4 * torch.randn(rows, 151_936, generator=gen, device="cuda")).bfloat16()
    temperatures = torch.arange(rows, device="cuda").remainder(2).double() * 0.8
    keys = torch.arange(rows, device="cuda") * 7919 - 3
    counters = torch.arange(rows, device="cuda") + 2**40
    tokens = triton_sampling.race_sample(logits, temperatures, keys, counters)
    expected = race_sampling.race_sample(*(t.cpu() for t in (logits, temperatures, keys, counters)))
    assert tokens.cpu().tolist() == expected.tolist()
    # under grammar masks (every third row unconstrained), read inside the race as a worker's draw does
    table = torch.randint(-2**31, 2**31 - 1, (rows, bitmask_words(151_936)), generator=gen, device="cuda",
                          dtype=torch.int64)
    mask_rows = torch.arange(rows, device="cuda").flip(0).masked_fill(torch.arange(rows, device="cuda") % 3 == 1, -1)
    masks = TokenMasks(table.to(torch.int32), mask_rows)
    tokens = triton_sampling.race_sample(logits, temperatures, keys, counters, masks)
    expected = race_sampling.race_sample(*(t.cpu() for t in (logits, temperatures, keys, counters)),
                                         TokenMasks(*(t.cpu() for t in masks)))
    assert tokens.cpu().tolist() == expected.tolist()


@needs_flash_attn
@pytest.mark.parametrize("case", flash_attn_shaped(PREFILL_CASES))
def test_flash_attn_prefill(case: Case) -> None:
    check_prefill(flash_attn_backend.paged_prefill, case, "cuda", seed=3)


@needs_flash_attn
@pytest.mark.parametrize("case", flash_attn_shaped(DECODE_CASES))
def test_flash_attn_decode(case: Case) -> None:
    check_decode(flash_attn_backend.paged_decode, case, "cuda", seed=4)


def test_e4m3_to_bf16_by_bits_is_exact_for_every_code() -> None:
    """The FP8 attention kernels' integer conversion against torch's cast, for all 254 finite codes
    (subnormals and both zeros included), bit for bit."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(src, dst, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(dst + offsets, triton_prefill.e4m3_to_bf16(tl.load(src + offsets)))

    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8, device="cuda")
    codes = torch.cat([codes, codes[:2]])  # 256 values: a power of two for tl.arange
    values = codes.view(torch.float8_e4m3fn)
    out = torch.empty(256, dtype=torch.bfloat16, device="cuda")
    convert[(1,)](values, out, BLOCK=256)
    expected = values.to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_gemv_matches_a_float64_product() -> None:
    """The batch-1 matrix-vector kernel at the 0.6B and 8B shapes (and an odd one), with a bias."""
    from nanoserve_kernels.triton_gemv import gemv
    generator = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((4096, 1024), (1024, 3072), (4096, 12288), (1000, 777)):
        x = torch.randn(1, k, device="cuda", generator=generator).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=generator) / k ** 0.5).bfloat16()
        bias = torch.randn(n, device="cuda", generator=generator).bfloat16()
        expected = torch.nn.functional.linear(x.double(), w.double(), bias.double())
        got = gemv(x, w, bias).double()
        assert ((got - expected).norm() / expected.norm()).item() < 5e-3, (n, k)


def test_fused_gemv_matches_the_separate_kernels_in_bf16() -> None:
    """The gemv with the norm made in its loads of x against the compiled norm then the gemv, at the
    Qwen3-0.6B and 8B q/k/v and gate/up shapes: x differs in at most 1 in 1,000 elements (by a step,
    where the inverse RMS's last bit flips a rounding), the product is the gemv of its x bit for bit,
    the residual the add's."""
    check_fused_gemv("cuda", torch.bfloat16, ((4096, 1024), (6144, 1024), (6144, 4096), (24576, 4096)),
                     norm_differ=1e-3, silu_differ=0.0)


def test_rms_norm_kernel_matches_the_compiled_function_in_bf16() -> None:
    """The Triton RMSNorm (with and without the residual add) gives torch.compile's output of the plain
    function (the kernel it replaced on CUDA), but for the inverse RMS's last bit (its sum's order) in at
    most 1 in 100 elements, and is within bf16's tolerance of float64."""
    from tests.worker.test_triton_rms_norm import check_rms_norm
    check_rms_norm("cuda", torch.bfloat16, plain_differ=1e-2, compiled=True)


def test_silu_and_mul_kernel_matches_the_compiled_function_in_bf16() -> None:
    """The Triton SiLU-and-mul gives torch.compile's output of the plain function (the kernel it
    replaced on CUDA), but for the exp's last bit in at most 1 in 1,000 elements."""
    check_silu_and_mul("cuda", torch.bfloat16, differ=1e-3)


def test_gate_up_silu_matches_the_separate_kernels_in_bf16() -> None:
    """The gate/up GEMM with SiLU-and-mul in its epilogue at the Qwen3-0.6B and 8B shapes against
    cuBLAS then the SiLU-and-mul kernel: equal but in at most 1 in 100 elements, which are a few steps
    of bf16 apart. It takes 2 to 128 rows of 16-bit floats, no more and no float32."""
    from nanoserve_kernels.triton_gate_up import MAX_ROWS, takes
    shapes = ((3072, 1024), (12288, 4096))
    check_gate_up_silu("cuda", torch.bfloat16, shapes, differ=1e-2)
    w = torch.empty(2 * 3072, 1024, dtype=torch.bfloat16, device="cuda")
    assert all(takes(torch.empty(rows, 1024, dtype=torch.bfloat16, device="cuda"), w) for rows in (2, MAX_ROWS))
    assert not any(takes(torch.empty(rows, 1024, dtype=torch.bfloat16, device="cuda"), w) for rows in (1, MAX_ROWS + 1))
    assert not takes(torch.empty(8, 1024, device="cuda"), w.float())
