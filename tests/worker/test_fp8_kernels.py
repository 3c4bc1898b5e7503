"""The FP8 weight kernels against the plain-torch reference (nanoserve_kernels/fp8_reference.py) on
dequantized values: the activations' quantization (bit for bit, on its own, by the RMSNorm and with the
SiLU-and-mul before it), the W8A8
and weight-only GEMMs (with the SiLU-and-mul epilogue and a bias, masked tails, M = 1, 2, 7, 64, 300, K split
over programs) and the matrix-vector kernel
reading e4m3 (with the RMSNorm prologue), on CPU through Triton's interpreter in float32 and float16
(its bfloat16 dots are wrong), and compiled for sm_90 in bfloat16 (the e4m3 tensor-core dots the
interpreter stands numpy in for). tests/gpu/test_fp8_weights_gpu.py runs the same checks on CUDA in
bfloat16. The interpreted checks run in a process of their own (tests/worker/interpreter.py says why)."""
import re
from typing import Callable

import pytest
import torch

from nanoserve_kernels import fp8_reference
from nanoserve_kernels.fp8_reference import quantize_weight
from tests.worker.test_triton_kernels import TOLERANCE, each_in_its_own_group, same_bits

ROWS = (1, 2, 7, 64, 300)
# (N, K, weight scale block): whole 128-blocks, a K tail inside the last block, per channel, the smallest
# blocks the kernels take (e4m3 dots need 32 columns).
SHAPES = ((256, 384, (128, 128)), (200, 320, (128, 128)), (96, 200, (1, 200)), (64, 64, (32, 32)))
SMALL_LAUNCH = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=4, num_warps=4, num_stages=2)
# (rows, K) quantized: one group, a row's last group cut short, a row over two programs (8 groups each) ending
# in a short group. A program quantizes 8 groups of one row, so 3 rows take every path that 33 take, in a
# tenth of the interpreter's programs.
QUANTIZE_SIZES = ((1, 128), (7, 200), (33, 1100))
INTERPRETED_QUANTIZE_SIZES = ((1, 128), (7, 200), (3, 1100))


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-30))


def random_fp8(n: int, k: int, block: tuple[int, int], device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(t.to(device) for t in quantize_weight(torch.randn(n, k, generator=generator) * 0.05, block))


def check_quantize(device: str, dtype: torch.dtype, sizes: tuple[tuple[int, int], ...] = QUANTIZE_SIZES) -> None:
    """Bit for bit the reference's e4m3 values and scales, in either scale layout, with padded rows."""
    from nanoserve_kernels.triton_fp8_quant import quantize_activation
    for rows, k in sizes:
        x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype).to(device)
        x[0, :5] = 0.0  # a group with zeros in it; the row's last group is cut short (masked) where k % 128
        expected_q, expected_s = fp8_reference.quantize_activation(x)
        for token_minor, padded in ((False, None), (True, rows + 3)):
            q, s = quantize_activation(x, token_minor=token_minor, padded_rows=padded)
            assert same_bits(q[:rows], expected_q) and torch.equal(s[:rows], expected_s), (rows, k, token_minor)
            assert s.stride(0) == (1 if token_minor else s.shape[1])


def check_silu_mul_quantize(device: str, dtype: torch.dtype,
                            sizes: tuple[tuple[int, int], ...] = QUANTIZE_SIZES) -> None:
    """The quantization pass reading the MLP's packed (gate, up): bit for bit the SiLU-and-mul pass, then the
    quantization of its output, in either scale layout, a row's last group cut short where K % 128."""
    from nanoserve_kernels.triton_activation import silu_and_mul
    from nanoserve_kernels.triton_fp8_quant import quantize_activation
    for rows, k in sizes:
        gate_up = (torch.randn(rows, 2 * k, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype).to(device)
        for token_minor, padded in ((False, None), (True, rows + 3)):
            expected_q, expected_s = quantize_activation(silu_and_mul(gate_up), token_minor=token_minor,
                                                         padded_rows=padded)
            q, s = quantize_activation(gate_up, token_minor=token_minor, padded_rows=padded, silu_mul=True)
            assert q.shape == expected_q.shape and s.stride() == expected_s.stride(), (rows, k)
            assert same_bits(q[:rows], expected_q[:rows]) and torch.equal(s[:rows], expected_s[:rows]), (rows, k)


def check_norm_quantize(device: str, dtype: torch.dtype) -> None:
    """The RMSNorm writing e4m3 activations: bit for bit the quantization of its 16-bit output, with and
    without the residual add, in either scale layout, a row's last group cut short where K % 128."""
    from nanoserve_kernels.triton_fp8_quant import quantize_activation
    from nanoserve_kernels.triton_rms_norm import rms_norm, rms_norm_fp8
    for rows, k in ((3, 200), (5, 384)):
        generator = torch.Generator().manual_seed(k)
        x, residual = ((torch.randn(rows, k, generator=generator) * 3).to(dtype).to(device) for _ in range(2))
        weight = (1 + 0.3 * torch.randn(k, generator=generator)).to(dtype).to(device)
        for with_residual, (token_minor, padded) in ((False, (False, None)), (True, (True, rows + 3))):
            unfused = rms_norm(x, weight, 1e-6, residual if with_residual else None)
            normed = unfused[0] if with_residual else unfused
            expected_q, expected_s = quantize_activation(normed, token_minor=token_minor, padded_rows=padded)
            (q, s), new_residual = rms_norm_fp8(x, weight, 1e-6, residual if with_residual else None,
                                                token_minor=token_minor, padded_rows=padded)
            assert same_bits(q[:rows], expected_q[:rows]) and torch.equal(s[:rows], expected_s[:rows]), (rows, k)
            assert s.stride() == expected_s.stride()
            assert (new_residual is None) if not with_residual else torch.equal(new_residual, unfused[1])


def check_gemm(device: str, dtype: torch.dtype, launch: dict = SMALL_LAUNCH,
               quantize_activation: Callable | None = None, rows_tried: tuple[int, ...] = ROWS,
               w8a8_modes: tuple[bool, ...] = (False, True), shapes: tuple = SHAPES) -> None:
    """W8A8 (x quantized by the kernel, or `quantize_activation`) and weight-only (`w8a8_modes`), plain and with
    the SiLU-and-mul and a bias, over `shapes` (N, K, weight scale block)."""
    from nanoserve_kernels.triton_fp8_gemm import fp8_gemm
    if quantize_activation is None:
        from nanoserve_kernels.triton_fp8_quant import quantize_activation
    for seed, (n, k, block) in ((SHAPES.index(shape), shape) for shape in shapes):
        weight, scale = random_fp8(n, k, block, device, seed)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
        shape_launch = dict(launch, BLOCK_K=min(launch["BLOCK_K"], block[1])) if scale.shape[1] > 1 else launch
        for rows in rows_tried:
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype).to(device)
            for w8a8 in w8a8_modes:
                expected = fp8_reference.fp8_linear(x, weight, scale, block, bias, quantize_input=w8a8)
                a, a_scale = quantize_activation(x) if w8a8 else (x, None)
                got = fp8_gemm(a, weight, scale, block, shape_launch, x_scale=a_scale, bias=bias, out_dtype=dtype)
                what = (n, k, block, rows, w8a8)
                assert relative_error(got, expected) < TOLERANCE[dtype], what
                if n % (2 * block[0]) == 0 or block[0] == 1:  # gate and up each whole scale blocks
                    gate, up = expected.float().chunk(2, dim=1)
                    got = fp8_gemm(a, weight, scale, block, shape_launch, x_scale=a_scale, bias=bias, silu_mul=True,
                                   out_dtype=dtype)
                    assert relative_error(got, torch.nn.functional.silu(gate) * up) < 2 * TOLERANCE[dtype], \
                        (*what, "silu")


def check_gemv(device: str, dtype: torch.dtype, convert: str = "triton", sum_once: bool = False,
               stream: bool = False, x_by_thread: bool = False) -> None:
    """One row through the matrix-vector kernel reading e4m3 (`convert`: how, triton_gemv.CONVERTS; `sum_once`:
    the block scales on x, one sum a row; `stream`: the weights loaded past L1; `x_by_thread`: x loaded as each
    thread's columns): plain, with a bias, with the RMSNorm prologue and the residual add, and with the
    SiLU-and-mul."""
    variant = dict(convert=convert, sum_once=sum_once, stream=stream, x_by_thread=x_by_thread)
    from nanoserve_kernels.triton_gemv import gemv, rms_norm_gemv
    from nanoserve_model.norm import rms_normalize
    for seed, (n, k, block) in enumerate(SHAPES):
        weight, scale = random_fp8(n, k, block, device, seed)
        generator = torch.Generator().manual_seed(seed)
        x, residual = (torch.randn(1, k, generator=generator).to(dtype).to(device) for _ in range(2))
        norm_weight, bias = torch.rand(k, generator=generator).to(dtype).to(device), None
        for bias in (None, torch.randn(n, generator=generator).to(dtype).to(device)):
            expected = fp8_reference.fp8_linear(x, weight, scale, block, bias)
            assert relative_error(gemv(x, weight, bias, weight_scale=scale, block=block, **variant), expected) \
                < TOLERANCE[dtype], (n, k, block, variant)
        normed = rms_normalize(x + residual, norm_weight, 1e-6)
        got, new_residual = rms_norm_gemv(x, residual, norm_weight, 1e-6, weight, weight_scale=scale, block=block,
                                          **variant)
        assert torch.allclose(new_residual, x + residual)
        assert relative_error(got, fp8_reference.fp8_linear(normed, weight, scale, block)) < 2 * TOLERANCE[dtype]
        if n % (2 * block[0]) == 0 or block[0] == 1:
            gate, up = fp8_reference.fp8_linear(normed, weight, scale, block).float().chunk(2, dim=1)
            got, _ = rms_norm_gemv(x, residual, norm_weight, 1e-6, weight, silu_mul=True, weight_scale=scale,
                                   block=block, **variant)
            assert relative_error(got, torch.nn.functional.silu(gate) * up) < 2 * TOLERANCE[dtype], \
                (n, k, "silu", variant)


def run_interpreted_cases(kernel: str) -> None:
    if kernel == "gemm":  # float16 only, in tiles as large as the rows allow: the interpreter is slow
        # x quantized by the reference, which check_quantize finds equal to the kernel bit for bit: the
        # interpreter runs the kernel a program a row (M = 300: ~3 s a shape). Every M on the whole blocks
        # (with the SiLU-and-mul) and on the tails; the per-channel and 32-wide blocks at M = 1 and 7, one
        # masked row block (their scales' paths do not depend on M; 70 rows below take two row blocks there)
        launch = dict(SMALL_LAUNCH, BLOCK_M=64, BLOCK_N=64)
        check_gemm("cpu", torch.float16, launch, fp8_reference.quantize_activation, shapes=SHAPES[:2])
        check_gemm("cpu", torch.float16, launch, fp8_reference.quantize_activation, rows_tried=(1, 7),
                   shapes=SHAPES[2:])
        # K split over 3 programs: a 128-column step each, or none (past K) for the narrower shapes; two row
        # blocks, the second masked (two output tiles a column, each with its own counter)
        check_gemm("cpu", torch.float16, dict(launch, SPLIT_K=3), fp8_reference.quantize_activation,
                   rows_tried=(70,))
        # W8A8 through tensor descriptors (where the rows are 16-byte aligned: the 200-column shape would rerun
        # the pointer path); edge tiles, and a split's steps past K, read as zeros (tests/gpu: unsplit too)
        check_gemm("cpu", torch.float16, dict(launch, SPLIT_K=3, TMA=True), fp8_reference.quantize_activation,
                   rows_tried=(70,), w8a8_modes=(True,), shapes=tuple(shape for shape in SHAPES if shape[1] % 16 == 0))
        # tiles computed transposed (SWAP_AB), both modes, at one row block and a masked one (the tile scale and
        # the per-column scales); then split, through tensor descriptors
        check_gemm("cpu", torch.float16, dict(SMALL_LAUNCH, BLOCK_M=16, BLOCK_N=64, SWAP_AB=True),
                   fp8_reference.quantize_activation, rows_tried=(20,))
        check_gemm("cpu", torch.float16, dict(SMALL_LAUNCH, BLOCK_M=32, BLOCK_N=64, SPLIT_K=3, SWAP_AB=True, TMA=True),
                   fp8_reference.quantize_activation, rows_tried=(40,), w8a8_modes=(True,),
                   shapes=tuple(shape for shape in SHAPES if shape[1] % 16 == 0))
        return
    if kernel == "gemv":  # Triton's conversion, then the integer one summing once a row, a dtype each (the PTX
        check_gemv("cpu", torch.float32)  # conversion runs on CUDA only: tests/gpu)
        check_gemv("cpu", torch.float16, convert="bits", sum_once=True, stream=True)
        return
    if kernel == "gemv_x_by_thread":  # x loaded as each thread's columns, with the words summed once (its block
        # scales on x), as the sweep offers it; tests/gpu also runs it with Triton's conversion
        check_gemv("cpu", torch.float16, convert="bits", sum_once=True, x_by_thread=True)
        return
    for dtype in (torch.float32, torch.float16):
        check_quantize("cpu", dtype, INTERPRETED_QUANTIZE_SIZES)
        check_norm_quantize("cpu", dtype)
        check_silu_mul_quantize("cpu", dtype, INTERPRETED_QUANTIZE_SIZES)


@pytest.mark.parametrize("kernel", each_in_its_own_group("fp8-interpreter",
                                                         ("quantize", "gemm", "gemv", "gemv_x_by_thread")))
def test_fp8_kernel_matches_reference_in_interpreter(interpreter, kernel: str) -> None:
    interpreter.run(__file__, kernel)


def _compile_for_hopper(kernel, types: dict[str, str], constexprs: dict, sixteens: tuple[str, ...] = (),
                        **options) -> str:
    """PTX for sm_90; `sixteens`: the arguments known divisible by 16, as Triton's launcher finds them at run
    time (aligned pointers, sizes and strides), which lets it load vectors."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.worker.test_triton_kernels import _hopper_signature
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in sixteens}
    source = ASTSource(kernel, _hopper_signature(kernel, types), constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def _loop_bodies(ptx: str) -> list[str]:
    """The PTX of each loop: from its label to the last branch back to it."""
    lines = ptx.splitlines()
    labels = {label.group(1): i for i, line in enumerate(lines) if (label := re.match(r"(\$L__BB\d+_\d+):", line))}
    bodies = {}
    for i, line in enumerate(lines):
        target = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if target and labels.get(target.group(1), i) < i:
            bodies[target.group(1)] = "\n".join(lines[labels[target.group(1)]:i + 1])
    return list(bodies.values())


@pytest.mark.parametrize("w8a8, silu_mul, launch", [
    (True, False, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)),
    (True, True, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, SPLIT_K=4)),
    (True, True, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)),
    (True, True, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, SPLIT_K=2, TMA=True)),
    (True, False, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, TMA=True)),
    (False, False, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)),
    (False, True, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)),
    (True, False, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)),
    (True, True, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, TMA=True,
                      SWAP_AB=True)),
    (True, False, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=6, SPLIT_K=2,
                       SWAP_AB=True)),
])
def test_fp8_gemm_compiles_for_hopper(w8a8: bool, silu_mul: bool, launch: dict) -> None:
    """sm_90 in bfloat16: W8A8 runs e4m3 tensor-core dots (the interpreter multiplies in numpy); the SiLU-and-mul
    variants with a bias; with K split, one thread a program counts it in its tile's counter (acquire-release);
    with TMA, x and the weight are tensor descriptors whose tiles the tensor-memory accelerator copies. W8A8 dots
    run on Hopper's warpgroup instructions (wgmma) where their M side is 64 rows or more: a tile of 64 batch rows,
    or any SWAP_AB tile (the weight's rows on that side); a 32-row tile unswapped takes the older mma.sync."""
    from nanoserve_kernels import triton_fp8_gemm
    tma = launch.get("TMA", False)
    tile = lambda rows: f"tensordesc<fp8e4nv[{rows}, {launch['BLOCK_K']}]>"  # noqa: E731
    types = {"a_ptr": tile(launch["BLOCK_M"]) if tma else "*fp8e4nv" if w8a8 else "*bf16", "a_scale_ptr": "*fp32",
             "w_ptr": tile(launch["BLOCK_N"]) if tma else "*fp8e4nv", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16",
             "out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32"}
    constexprs = dict(SCALE_BN=128, SCALE_BK=128, ACT_GROUP=128, W8A8=w8a8, SILU_MUL=silu_mul, HAS_BIAS=silu_mul,
                      **{name: launch[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")},
                      SPLIT_K=launch.get("SPLIT_K", 1), TILE_SCALE=w8a8, TMA=tma,  # a weight scale a tile, or a column
                      SWAP_AB=launch.get("SWAP_AB", False))
    ptx = _compile_for_hopper(triton_fp8_gemm._fp8_gemm_kernel, types, constexprs, num_warps=launch["num_warps"],
                              num_stages=launch["num_stages"])
    assert "e4m3" in ptx
    assert ptx.count("atom.global.gpu.acq_rel.add") == (launch.get("SPLIT_K", 1) > 1)
    assert ("cp.async.bulk.tensor.2d" in ptx) == tma
    if w8a8:
        assert ("wgmma.mma_async" in ptx) == (launch["BLOCK_M"] >= 64 or launch.get("SWAP_AB", False))


@pytest.mark.parametrize("mode, silu_mul, convert, sum_once, stream", [
    ("block", False, "triton", False, False), ("block", True, "triton", False, False),
    ("row", False, "triton", False, False), ("row", True, "triton", False, False), ("block", True, "ptx", True, True),
    ("row", False, "bits", False, False)])
def test_fp8_gemv_compiles_for_hopper(mode: str, silu_mul: bool, convert: str, sum_once: bool, stream: bool) -> None:
    """Each way of reading e4m3: Triton's conversion and Hopper's paired convert (inline PTX, which the
    interpreter cannot run) take the e4m3 converts, the integer one none; STREAM loads the weights past L1."""
    from nanoserve_kernels import triton_gemv
    types = {name: "*bf16" for name in ("x_ptr", "residual_ptr", "residual_out_ptr", "norm_ptr", "bias_ptr", "y_ptr")}
    types |= {"w_ptr": "*fp8e4nv" if convert == "triton" else "*i32", "scale_ptr": "*fp32", "eps": "fp32"}
    constexprs = dict(BLOCK_N=4, BLOCK_K=2048, HAS_BIAS=False, PROLOGUE="rms_norm", HAS_RESIDUAL=True,
                      SILU_MUL=silu_mul, PDL=False, WEIGHT_SCALE=mode, SCALE_BN=128 if mode == "block" else 1,
                      SCALE_BK=128, CONVERT=convert, SUM_ONCE=sum_once, STREAM=stream)
    ptx = _compile_for_hopper(triton_gemv._gemv_kernel, types, constexprs, num_warps=4)
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == (convert != "bits")
    assert ("ld.global.cg" in ptx) == stream


@pytest.mark.parametrize("silu_mul, prologue, block_n, block_k, warps", [
    (True, "rms_norm", 4, 2048, 4), (False, "none", 4, 4096, 8)])
def test_fp8_gemv_x_by_thread_loop_has_no_barrier(silu_mul: bool, prologue: str, block_n: int, block_k: int,
                                                  warps: int) -> None:
    """At tiles whose columns spread over every thread (triton_gemv.thread_spanning_columns), x loaded by thread
    (X_BY_THREAD) is in the layout the products take it in: no loop of the kernel (the norm's, the tiles')
    passes anything through shared memory or waits at a barrier, where x loaded as a tile does, every tile
    (the gate/up call with the norm, as the 8B model makes it, and 8 warps without a prologue)."""
    from nanoserve_kernels import triton_gemv
    assert block_k >= triton_gemv.thread_spanning_columns(warps)
    types = {name: "*bf16" for name in ("x_ptr", "residual_ptr", "residual_out_ptr", "norm_ptr", "bias_ptr", "y_ptr")}
    types |= {"w_ptr": "*i32", "scale_ptr": "*fp32", "eps": "fp32"}
    sixteens = (*types.keys() - {"eps"}, "N", "K", "stride_w", "stride_scale")
    barriers = {}
    for x_by_thread in (False, True):
        constexprs = dict(BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=False, PROLOGUE=prologue,
                          HAS_RESIDUAL=prologue == "rms_norm", SILU_MUL=silu_mul, PDL=False, WEIGHT_SCALE="block",
                          SCALE_BN=128, SCALE_BK=128, CONVERT="ptx", SUM_ONCE=True, STREAM=False,
                          X_BY_THREAD=x_by_thread)
        ptx = _compile_for_hopper(triton_gemv._gemv_kernel, types, constexprs, sixteens, num_warps=warps)
        loops = _loop_bodies(ptx)
        assert len(loops) == 1 + (prologue == "rms_norm"), len(loops)
        barriers[x_by_thread] = [loop.count("bar.sync") + loop.count(".shared") for loop in loops]
    assert max(barriers[False]) > 0 and barriers[True] == [0] * len(barriers[True]), barriers


def test_activation_quantization_compiles_for_hopper() -> None:
    from nanoserve_kernels import triton_fp8_quant, triton_rms_norm
    types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    for silu_mul in (False, True):  # the SiLU-and-mul before it: its exp
        constexprs = dict(GROUP=128, GROUPS=8, FP8_MAX=448.0, AMAX_FLOOR=1e-12, SILU_MUL=silu_mul)
        ptx = _compile_for_hopper(triton_fp8_quant._quantize_groups_kernel, types, constexprs, num_warps=4)
        assert "e4m3" in ptx and ("ex2.approx" in ptx) == silu_mul
    types = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*fp8e4nv",
             "residual_out_ptr": "*bf16", "scale_ptr": "*fp32", "eps": "fp32"}
    constexprs = dict(HAS_RESIDUAL=True, BLOCK=4096, GROUP=128, FP8_MAX=448.0, AMAX_FLOOR=1e-12)
    assert "e4m3" in _compile_for_hopper(triton_rms_norm._rms_norm_kernel, types, constexprs, num_warps=8)
