"""The fused MoE kernels (nanoserve_kernels/fused_moe.py) against the plain per-expert loop
(moe_reference.py) on CPU through Triton's interpreter, in float32 and float16 (its bf16 dot is wrong):
routing, sort-and-pad, and whole layers at batch 1 and with experts that get no token, with tiles that
leave tails in every dimension, their experts in the model dtype or e4m3 with block (or per-channel) scales
(against the loop on the dequantized weights). The cases run in a process with TRITON_INTERPRET=1 set from
the start (tests/worker/interpreter.py says why); tests/gpu/test_moe_gpu.py reuses the checks in bf16 on
CUDA. Also: the GEMM compiles for sm_90 in bf16, of bf16 and of e4m3 experts."""
import json

import pytest
import torch

from nanoserve_kernels.moe_reference import BlockScales, dequantize_experts, experts_reference, quantize_experts, route
from tests.worker.test_triton_kernels import each_in_its_own_group

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SMALL_TILES = dict(BLOCK_M=16, gate_up=dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2),
                   down=dict(BLOCK_N=32, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2))
# (tokens, experts, top_k, hidden, expert width, experts left without a token)
LAYER_CASES = ((1, 8, 2, 64, 32, 0), (5, 8, 2, 72, 24, 3), (33, 16, 4, 48, 40, 5))
# FP8 experts: (tokens, experts, top_k, hidden, expert width, idle experts, scale block; None: per channel).
# Widths are whole row blocks (gate packs up right after it); hidden 72 leaves a K tail inside gate/up's last
# block and a row tail in down's last block.
FP8_CASES = ((1, 8, 2, 64, 32, 0, (16, 32)), (5, 8, 2, 72, 32, 3, (16, 32)), (17, 16, 4, 48, 48, 5, (16, 16)),
             (7, 8, 2, 40, 24, 2, None))


def separated_logits(tokens: int, experts: int, seed: int, idle: int = 0, device: str = "cpu") -> torch.Tensor:
    """Router logits whose sorted values are at least 0.05 apart in every row (no near-ties to
    break differently), the last `idle` experts never in anyone's top-k."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(experts - idle, generator=g) for _ in range(tokens)]).float()
    busy = ranks * 0.3 + torch.rand(tokens, experts - idle, generator=g) * 0.2
    return torch.cat([busy, torch.full((tokens, idle), -30.0)], dim=1).to(device)


def check_route(route_kernel, device: str) -> None:
    for seed, (tokens, experts, top_k) in enumerate(((1, 8, 2), (7, 128, 8), (3, 60, 5), (4, 16, 16))):
        logits = separated_logits(tokens, experts, seed, device=device)
        for renormalize in (True, False):
            weights, ids = route_kernel(logits, top_k, renormalize)
            expected_weights, expected_ids = route(logits, top_k, renormalize)
            assert torch.equal(ids.long(), expected_ids), (tokens, experts, top_k)
            assert torch.allclose(weights, expected_weights, rtol=1e-5, atol=1e-7), (tokens, experts, top_k)


def check_align(align_block_size, device: str) -> None:
    """Every pair once, in its expert's run, runs in expert order and padded to BLOCK_M, pairs of an
    expert in token order; padding names no pair."""
    for seed, (tokens, experts, top_k, idle, block_m) in enumerate(((1, 8, 2, 0, 16), (9, 16, 4, 6, 16),
                                                                    (40, 8, 8, 0, 32), (300, 64, 4, 20, 16))):
        ids = route(separated_logits(tokens, experts, seed, idle), top_k, True)[1].int().to(device)
        sorted_pairs, block_experts, num_padded = align_block_size(ids, experts, block_m)
        flat, num_pairs = ids.flatten().cpu(), ids.numel()
        counts = torch.bincount(flat.long(), minlength=experts)
        padded = (counts + block_m - 1) // block_m * block_m
        assert num_padded.item() == padded.sum().item() <= sorted_pairs.numel()
        rows = sorted_pairs[:num_padded.item()].cpu()
        owners = block_experts[:num_padded.item() // block_m].cpu().repeat_interleave(block_m)
        assert owners.tolist() == torch.arange(experts).repeat_interleave(padded).tolist()
        real = rows < num_pairs
        assert sorted(rows[real].tolist()) == list(range(num_pairs))
        assert torch.equal(flat[rows[real].long()], owners[real])
        for expert in range(experts):
            mine = rows[real & (owners == expert)]
            assert torch.equal(mine, mine.sort().values)
        assert (sorted_pairs[num_padded.item():].cpu() == num_pairs).all()


def check_route_and_align(route_and_align, align_block_size, device: str) -> None:
    """The one-launch form at decode sizes: the reference's routing and the separate sort's very rows."""
    for seed, (tokens, experts, top_k, idle, block_m) in enumerate(((1, 8, 2, 0, 16), (9, 16, 4, 6, 16),
                                                                    (4, 128, 8, 0, 16), (32, 64, 8, 30, 32))):
        logits = separated_logits(tokens, experts, seed, idle, device)
        for renormalize in (True, False):
            weights, ids, sort = route_and_align(logits, top_k, renormalize, block_m)
            expected_weights, expected_ids = route(logits, top_k, renormalize)
            assert torch.equal(ids.long(), expected_ids) and torch.allclose(weights, expected_weights, rtol=1e-5)
            sorted_pairs, block_experts, num_padded = align_block_size(expected_ids.int(), experts, block_m)
            rows = num_padded.item()
            assert sort[2].item() == rows and torch.equal(sort[0], sorted_pairs)
            assert torch.equal(sort[1][:rows // block_m], block_experts[:rows // block_m]), (tokens, experts)


def check_layers(fused_experts, device: str, dtype: torch.dtype, launches: tuple[dict | None, ...]) -> None:
    for seed, (tokens, experts, top_k, hidden_size, width, idle) in enumerate(LAYER_CASES):
        g = torch.Generator().manual_seed(100 + seed)
        hidden = torch.randn(tokens, hidden_size, generator=g).to(device, dtype)
        gate_up = (torch.randn(experts, 2 * width, hidden_size, generator=g) * 0.2).to(device, dtype)
        down = (torch.randn(experts, hidden_size, width, generator=g) * 0.2).to(device, dtype)
        weights, ids = route(separated_logits(tokens, experts, seed, idle, device), top_k, True)
        expected = experts_reference(hidden.double(), gate_up.double(), down.double(), weights.double(), ids)
        outs = {str(launch): fused_experts(hidden, gate_up, down, weights, ids.int(), launch) for launch in launches}
        from nanoserve_kernels.fused_moe import fused_moe  # from the logits: at these sizes one launch routes and sorts
        outs["from logits"] = fused_moe(hidden, gate_up, down, separated_logits(tokens, experts, seed, idle, device),
                                        top_k, True)
        for how, out in outs.items():
            assert out.dtype == dtype and out.shape == hidden.shape
            error = ((out.double() - expected).norm() / expected.norm()).item()
            assert error < TOLERANCE[dtype], (tokens, experts, top_k, dtype, how, error)


def check_fp8_layers(fused_experts, device: str, dtype: torch.dtype, launches: tuple[dict | None, ...]) -> None:
    """e4m3 experts with block (or per-channel) scales against the per-expert loop on their dequantized values."""
    for seed, (tokens, experts, top_k, hidden_size, width, idle, block) in enumerate(FP8_CASES):
        g = torch.Generator().manual_seed(200 + seed)
        hidden = torch.randn(tokens, hidden_size, generator=g).to(device, dtype)
        gate_up, gate_up_scales = quantize_experts(torch.randn(experts, 2 * width, hidden_size, generator=g) * 0.2,
                                                   block or (1, hidden_size))
        down, down_scales = quantize_experts(torch.randn(experts, hidden_size, width, generator=g) * 0.2,
                                             block or (1, width))
        weights, ids = route(separated_logits(tokens, experts, seed, idle), top_k, True)
        expected = experts_reference(hidden.double().cpu(), dequantize_experts(gate_up, gate_up_scales, torch.float64),
                                     dequantize_experts(down, down_scales, torch.float64), weights.double(), ids)
        on = [t.to(device) for t in (gate_up, gate_up_scales.scale, down, down_scales.scale)]
        scales = dict(gate_up_scales=BlockScales(on[1], gate_up_scales.block),
                      down_scales=BlockScales(on[3], down_scales.block))
        for launch in launches:
            out = fused_experts(hidden, on[0], on[2], weights.to(device), ids.int().to(device), launch, **scales)
            error = ((out.double().cpu() - expected).norm() / expected.norm()).item()
            assert out.dtype == dtype and error < TOLERANCE[dtype], (tokens, experts, block, dtype, launch, error)


def run_interpreted_cases(kernel: str) -> None:
    if kernel == "route":
        from nanoserve_kernels.triton_moe_routing import route as route_kernel
        check_route(route_kernel, "cpu")
    elif kernel == "align":
        from nanoserve_kernels.triton_moe_align import align_block_size, route_and_align
        check_align(align_block_size, "cpu")
        check_route_and_align(route_and_align, align_block_size, "cpu")
    elif kernel == "fp8":  # float32 in full precision, float16 through the defaults' tiles too
        from nanoserve_kernels.fused_moe import fused_experts
        check_fp8_layers(fused_experts, "cpu", torch.float32, (SMALL_TILES,))
        check_fp8_layers(fused_experts, "cpu", torch.float16, (SMALL_TILES, None))
    else:
        from nanoserve_kernels.fused_moe import fused_experts
        check_layers(fused_experts, "cpu", getattr(torch, kernel), (SMALL_TILES, None))


@pytest.mark.parametrize("kernel", each_in_its_own_group("moe-interpreter", ("route", "align", "float32", "float16",
                                                                     "fp8")))
def test_moe_kernels_match_the_reference_in_interpreter(interpreter, kernel: str) -> None:
    interpreter.run(__file__, kernel, timeout=300)


def test_a_step_takes_the_config_tuned_for_the_next_batch_size_up(monkeypatch, tmp_path):
    from nanoserve_kernels import moe_launch
    monkeypatch.setattr(moe_launch, "CONFIG_DIR", tmp_path)
    moe_launch.tuned_configs.cache_clear()
    assert moe_launch.launch_config(3, 128, 768, "NVIDIA H100 80GB HBM3") == moe_launch.default_config(3, 128)
    tuned = {batch: dict(SMALL_TILES, BLOCK_M=block_m) for batch, block_m in ((1, 16), (8, 32), (64, 64))}
    (tmp_path / "E128_N768_NVIDIA_H100_80GB_HBM3.json").write_text(json.dumps({"configs": tuned}))
    moe_launch.tuned_configs.cache_clear()
    picked = [moe_launch.launch_config(tokens, 128, 768, "NVIDIA H100 80GB HBM3")["BLOCK_M"]
              for tokens in (1, 2, 8, 9, 64, 4096)]
    assert picked == [16, 32, 32, 64, 64, 64]
    moe_launch.tuned_configs.cache_clear()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("silu_mul, block_m", [(True, 16), (False, 64)])
def test_grouped_gemm_compiles_for_hopper_in_bf16(silu_mul: bool, block_m: int, fp8: bool) -> None:
    """The interpreter runs float32 dots without wgmma: each GEMM's bf16 form must compile for sm_90, with
    the epilogue it has (SiLU-and-mul for gate/up, the routing weights for down), of bf16 experts and of
    e4m3 ones with 128 x 128 block scales (their tiles converted to bf16 in registers)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanoserve_kernels import triton_moe_gemm
    from tests.worker.test_triton_kernels import _hopper_signature
    kernel = triton_moe_gemm._grouped_gemm_kernel
    types = {"a_ptr": "*bf16", "b_ptr": "*fp8e4nv" if fp8 else "*bf16", "c_ptr": "*bf16", "pair_weights_ptr": "*fp32",
             "sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32", "num_padded_ptr": "*i32",
             "b_scale_ptr": "*fp32" if fp8 else "*bf16"}
    constexprs = dict(PAIRS_PER_A_ROW=8 if silu_mul else 1, SILU_MUL=silu_mul, MUL_WEIGHTS=not silu_mul,
                      FP8_WEIGHTS=fp8, SCALE_BN=128 if fp8 else 1, SCALE_BK=128 if fp8 else 1,
                      BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, PRECISION="tf32")
    source = ASTSource(kernel, _hopper_signature(kernel, types), constexprs=constexprs)
    options = dict(num_warps=4, num_stages=3)
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def test_route_and_align_compiles_for_hopper() -> None:
    """The one-launch routing and sort (runtime loops over tokens and blocks, a barrier between its stores
    and loads) for sm_90 at Qwen3-30B-A3B's 128 experts and top-8."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanoserve_kernels import triton_moe_align
    from tests.worker.test_triton_kernels import _hopper_signature
    kernel = triton_moe_align._route_and_align_kernel
    types = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32", "sorted_pairs_ptr": "*i32",
             "block_experts_ptr": "*i32", "num_padded_ptr": "*i32"}
    constexprs = dict(TOP_K=8, BLOCK_E=128, BLOCK_K=8, RENORMALIZE=True, BLOCK_P=64, BLOCK_M=16, SCAN=64)
    source = ASTSource(kernel, _hopper_signature(kernel, types), constexprs=constexprs)
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["cubin"]
