"""FP8 weights on CUDA: the kernels against the plain-torch reference in bfloat16 (the interpreter's
checks of tests/worker/test_fp8_kernels.py, with the launch shapes serving uses), every batch size
through the dispatch (fp8_linear, as the tuned or default table routes it), the RMSNorm quantizing for the
W8A8 GEMM, torch's blockwise scaled_mm where this torch has it, DeepGEMM where it is installed (alone,
compiled ahead on threads, and serving), and the whole model: the next-token KL of the W8A8 path over 1,024
positions against transformers in float32 on the dequantized weights, beside the bf16-vs-fp32 KL floor (the
dequantized weights served unquantized in bfloat16); and serving with FP8 weights through the step
graphs (decode and piecewise prefill, with and without an FP8 KV cache) gives the eager path's greedy
tokens. Run with -s to see the numbers:
    PYTHONPATH=.:proto python3 -m pytest tests/gpu/test_fp8_weights_gpu.py -q -s
"""
import functools
import json
import logging
import os
import random
from pathlib import Path

import pytest
import torch

from nanoserve_cli.demo_model import config_json, random_weights, write_checkpoint
from nanoserve_cli.fp8_checkpoint import write_fp8_checkpoint
from nanoserve_kernels import fp8_configs, fp8_reference
from nanoserve_kernels.fp8_configs import SCALED_MM, W8A8, Fp8Choice
from nanoserve_model.step_context import step_context
from tests.worker.fp8_models import write_dequantized
from tests.worker.test_fp8_kernels import (ROWS, check_gemm, check_gemv, check_norm_quantize, check_quantize,
                                           check_silu_mul_quantize, random_fp8, relative_error)
from tests.worker.test_triton_kernels import TOLERANCE, same_bits
from tests.worker.worker_steps import StepWriter, generate
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner
from worker_svc.step_inputs import build_step_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# A random model whose dimensions are whole 128-blocks (q 256 rows, k/v 128 each), at a weight scale
# whose next-token distributions are not uniform (entropy ~10.7 nats of the vocabulary's 11.9).
KL_SHAPE = dict(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
KL_STD = 0.1
NUM_SEQS, SEQ_LEN, BLOCK_SIZE = 4, 256, 16
# W8A8 may move the distributions this many times further than bf16 alone moves them from float32, or
# this many nats per position. On CPU, W8A8 simulated in float32 on this model: 1.3e-2 nats, 23x the
# bf16 floor of 5.7e-4 (random weights amplify errors more than trained ones).
KL_BOUND_OVER_FLOOR = 60.0
KL_BOUND_NATS = 3e-3


def test_quantize_gemm_and_gemv_match_the_reference_in_bfloat16():
    check_quantize("cuda", torch.bfloat16)
    check_norm_quantize("cuda", torch.bfloat16)
    check_silu_mul_quantize("cuda", torch.bfloat16)
    # each way the matrix-vector kernel reads e4m3 (the PTX one runs only here), sums and loads x
    for convert, sum_once, stream, x_by_thread in (("triton", False, False, False), ("ptx", True, True, False),
                                                   ("ptx", False, False, False), ("bits", False, True, False),
                                                   ("ptx", True, False, True), ("triton", False, False, True)):
        check_gemv("cuda", torch.bfloat16, convert, sum_once, stream, x_by_thread)
    for rows in (2, 64, 300, 4096):  # the default launch shapes of their buckets
        check_gemm("cuda", torch.bfloat16, fp8_configs.default_choice(fp8_configs.bucket(rows)).launch)
    for split_k in (2, 3):  # K split over programs, a step each or more, some splits past K
        check_gemm("cuda", torch.bfloat16, dict(fp8_configs.default_choice(64).launch, SPLIT_K=split_k))
    for split_k in (1, 3):  # the tiles copied by the tensor-memory accelerator, in the tuner's 128 x 128 tiles too
        for launch in (fp8_configs.default_choice(64).launch, fp8_configs.default_choice(512).launch):
            check_gemm("cuda", torch.bfloat16, dict(launch, SPLIT_K=split_k, TMA=True))
    for launch in (dict(BLOCK_M=16, BLOCK_N=64), dict(BLOCK_M=64, BLOCK_N=128, SPLIT_K=2, TMA=True)):  # transposed
        check_gemm("cuda", torch.bfloat16, dict(fp8_configs.default_choice(64).launch, **launch, SWAP_AB=True),
                   w8a8_modes=(False, True) if "TMA" not in launch else (True,))


@pytest.mark.parametrize("block", [(128, 128), (1, 4096)])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_every_batch_size_through_the_dispatch(block, silu_mul):
    """The 8B shape's gate/up (12,288 x 2 rows, 4,096 columns) at each of the issue's batch sizes, as
    fp8_linear routes them (matrix-vector, weight-only or W8A8, Triton or scaled_mm), against the
    reference of the mode it took."""
    from nanoserve_kernels.fp8_linear import choice, fp8_gate_up_silu, fp8_linear
    weight, scale = random_fp8(2 * 12288, 4096, block, "cuda", 0)
    for rows in ROWS + (4096,):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        w8a8 = rows > 1 and choice(rows, weight, silu_mul).mode == W8A8
        expected = fp8_reference.fp8_linear(x, weight, scale, block, quantize_input=w8a8)
        if silu_mul:
            if rows == 1:
                continue
            gate, up = expected.float().chunk(2, dim=1)
            expected, got = torch.nn.functional.silu(gate) * up, fp8_gate_up_silu(x, weight, scale, block)
        else:
            got = fp8_linear(x, weight, scale, block)
        assert relative_error(got, expected) < 2 * TOLERANCE[torch.bfloat16], (rows, w8a8)


@pytest.mark.parametrize("silu_mul", [False, True])
def test_the_norm_quantizing_for_the_projection_gives_the_unfused_output(silu_mul):
    """The RMSNorm writing the W8A8 GEMM's e4m3 activations (in the layout of the GEMM the table chose: Triton's
    or torch's scaled_mm) gives the norm-then-quantize activations and the norm-then-project result, on the 8B
    gate/up at each batch size where the projection quantizes its input. Compiled, the two norm variants may
    sum a row's squares in different orders (the quantizing one's layout follows its reshape into groups), so
    a rare element may round to the neighbouring e4m3 value: at most 1 in 10,000, one step apart, where the
    interpreter's test (tests/worker/test_fp8_kernels.py) holds them bit for bit."""
    from nanoserve_kernels.fp8_linear import fp8_gate_up_silu, fp8_linear, input_quantization, quantized_linear
    from nanoserve_kernels.triton_fp8_quant import quantize_activation
    from nanoserve_kernels.triton_rms_norm import rms_norm, rms_norm_fp8
    weight, scale = random_fp8(2 * 12288, 4096, (128, 128), "cuda", 0)
    norm_weight = (1 + 0.3 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    quantized_batches = 0
    for rows in ROWS + (4096,):
        x, residual = torch.randn(2, rows, 4096, device="cuda", dtype=torch.bfloat16).unbind(0)
        layout = input_quantization(x, weight, (128, 128), silu_mul)
        if layout is None:
            continue
        quantized_batches += 1
        normed, new_residual = rms_norm(x, norm_weight, 1e-6, residual)
        expected = (fp8_gate_up_silu if silu_mul else fp8_linear)(normed, weight, scale, (128, 128))
        quantized, fused_residual = rms_norm_fp8(x, norm_weight, 1e-6, residual, **layout)
        assert torch.equal(fused_residual, new_residual), (rows, layout)
        (fused_q, fused_scale), (unfused_q, unfused_scale) = quantized, quantize_activation(normed, **layout)
        fused_q, unfused_q = fused_q[:rows].float(), unfused_q[:rows].float()
        differ = fused_q != unfused_q
        steps = (fused_q - unfused_q).abs() / unfused_q.abs().clamp(min=2.0 ** -6)
        assert differ.float().mean() <= 1e-4 and (steps[differ] <= 0.125).all(), (rows, layout, int(differ.sum()))
        # a scale may follow a group maximum one bf16 step off
        torch.testing.assert_close(fused_scale[:rows], unfused_scale[:rows], rtol=2.0 ** -7, atol=0)
        got = quantized_linear(quantized, rows, x.dtype, weight, scale, (128, 128), silu_mul=silu_mul)
        assert relative_error(got, expected) < 1e-3, (rows, layout, relative_error(got, expected))
    assert quantized_batches  # the table runs W8A8 somewhere among these batch sizes


def test_the_silu_mul_pass_quantizing_for_the_down_projection_gives_the_unfused_output():
    """After torch's scaled_mm on the 8B gate/up, the SiLU-and-mul pass that quantizes for the down projection's
    W8A8 GEMM (in the layout of the GEMM the table chose for it) gives the e4m3 values and scales of the SiLU-
    and-mul then its quantization, bit for bit, and so the down projection's very output, at each batch size
    where the down projection quantizes its input."""
    from nanoserve_kernels.fp8_linear import fp8_linear, input_layout, input_quantization, quantized_linear
    from nanoserve_kernels.triton_fp8_quant import quantize_activation
    gate_up, gate_up_scale = random_fp8(2 * 12288, 4096, (128, 128), "cuda", 0)
    down, down_scale = random_fp8(4096, 12288, (128, 128), "cuda", 1)
    chosen = Fp8Choice(W8A8, SCALED_MM)
    fused_batches = 0
    for rows in ROWS + (4096,):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        layout = input_quantization(x, down, (128, 128), columns=12288)
        if layout is None:
            continue
        fused_batches += 1
        quantized_x = quantize_activation(x, **input_layout(chosen, x.shape, gate_up, (128, 128)))
        project = functools.partial(quantized_linear, quantized_x, rows, x.dtype, gate_up, gate_up_scale, (128, 128),
                                    silu_mul=True, chosen=chosen)
        try:
            activation = project()
        except (AttributeError, RuntimeError, NotImplementedError) as err:
            pytest.skip(f"torch {torch.__version__} has no blockwise scaled_mm here: {type(err).__name__}: {err}")
        fused_q, fused_scale = project(output_layout=layout)
        unfused_q, unfused_scale = quantize_activation(activation, **layout)
        assert same_bits(fused_q[:rows], unfused_q[:rows]), (rows, layout)
        assert torch.equal(fused_scale[:rows], unfused_scale[:rows]), (rows, layout)
        got = quantized_linear((fused_q, fused_scale), rows, x.dtype, down, down_scale, (128, 128))
        assert torch.equal(got, fp8_linear(activation, down, down_scale, (128, 128))), (rows, layout)
    assert fused_batches  # the table runs the down projection W8A8 somewhere among these batch sizes


@pytest.mark.parametrize("seqs", [4, 64, 256])
def test_the_decode_attention_quantizing_for_the_o_projection_gives_the_unfused_output(seqs):
    """The 8B shape's decode attention (32 heads over 8 KV heads of 128) writing its output quantized for the o
    projection (each head one group; the scales token-minor in padded rows, the layout of scaled_mm and
    DeepGEMM): the e4m3 values and scales of its 16-bit output quantized by the pass, bit for bit, from the
    decode kernel's store (64 and 256 sequences) and from the merge of split contexts (4)."""
    from nanoserve_kernels.triton_decode import num_splits, paged_decode
    from nanoserve_kernels.triton_fp8_quant import empty_quantized, quantize_activation
    from tests.worker.test_triton_kernels import Case, make_paged_batch
    rng = random.Random(seqs)
    case = Case(new_lens=(1,) * seqs, context_lens=tuple(rng.randrange(1, 900) for _ in range(seqs)), heads=32,
                kv_heads=8, head_dim=128, block_size=256, dtype=torch.bfloat16)
    batch = make_paged_batch(case, "cuda", seqs)
    assert (num_splits(seqs, 8, torch.device("cuda")) > 1) == (seqs == 4)
    out = paged_decode(*batch.decode_args(), 128 ** -0.5)
    layout = dict(token_minor=True, padded_rows=-(-seqs // 64) * 64 + 4)
    quantized = paged_decode(*batch.decode_args(), 128 ** -0.5,
                             quantized_out=empty_quantized(seqs, 32 * 128, out.device, **layout))
    expected = quantize_activation(out.flatten(1), **layout)
    assert same_bits(quantized[0][:seqs], expected[0][:seqs]) and torch.equal(quantized[1][:seqs], expected[1][:seqs])


def test_torch_blockwise_scaled_mm_matches_the_reference_where_it_runs():
    """The W8A8 path through torch's blockwise scaled_mm, as the table may choose it: x quantized in the
    layout cuBLAS wants (scales token-minor, rows padded to a multiple of 4), 300 rows."""
    from nanoserve_kernels.fp8_linear import input_layout, quantized_linear
    from nanoserve_kernels.triton_fp8_quant import quantize_activation
    weight, scale = random_fp8(4096, 4096, (128, 128), "cuda", 1)
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    chosen = Fp8Choice(W8A8, SCALED_MM)
    quantized = quantize_activation(x, **input_layout(chosen, x.shape, weight, (128, 128)))
    try:
        got = quantized_linear(quantized, len(x), x.dtype, weight, scale, (128, 128), chosen=chosen)
    except (AttributeError, RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch {torch.__version__} has no blockwise scaled_mm here: {type(err).__name__}: {err}")
    expected = fp8_reference.fp8_linear(x, weight, scale, (128, 128), quantize_input=True)
    assert relative_error(got, expected) < 2 * TOLERANCE[torch.bfloat16]


def test_deepgemm_matches_the_reference_at_decode_batches_where_installed():
    """The W8A8 path through DeepGEMM, as the table may choose it at decode buckets: x quantized in its layout
    (rows padded to the bucket, the padding unwritten), q/k/v- and gate/up-shaped weights (the SiLU-and-mul
    after it, and that pass quantizing for the down projection), rows of every bucket and between them."""
    from nanoserve_kernels import deepgemm_fp8
    from nanoserve_kernels.fp8_configs import DEEPGEMM
    from nanoserve_kernels.fp8_linear import input_layout, quantized_linear, takes_deepgemm
    from nanoserve_kernels.triton_fp8_quant import quantize_activation
    if not deepgemm_fp8.available():
        pytest.skip("DeepGEMM is not installed here (bench/deepgemm.sh)")
    chosen = Fp8Choice(W8A8, DEEPGEMM)
    for n, silu_mul in ((1536, False), (2 * 1024, True)):
        weight, scale = random_fp8(n, 1024, (128, 128), "cuda", n)
        for rows in (2, 7, 64, 100, 144, 256):
            assert takes_deepgemm(rows, weight, (128, 128), scale)
            x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
            quantized = quantize_activation(x, **input_layout(chosen, x.shape, weight, (128, 128)))
            assert quantized[0].shape[0] == deepgemm_fp8.padded_rows(rows)
            got = quantized_linear(quantized, rows, x.dtype, weight, scale, (128, 128), silu_mul=silu_mul,
                                   chosen=chosen)
            expected = fp8_reference.fp8_linear(x, weight, scale, (128, 128), quantize_input=True)
            if silu_mul:
                gate, up = expected.float().chunk(2, dim=1)
                expected = torch.nn.functional.silu(gate) * up
            assert got.shape == expected.shape and relative_error(got, expected) < 2 * TOLERANCE[torch.bfloat16], rows


def test_deepgemm_kernels_compile_ahead_on_threads_then_serve_where_installed():
    """deepgemm_fp8.compile_ahead, as a worker's start runs it (pool threads, several kernels at once), then
    each kernel called from this thread against the reference."""
    from nanoserve_kernels import deepgemm_fp8
    from nanoserve_kernels.triton_fp8_quant import quantize_activation
    if not deepgemm_fp8.available():
        pytest.skip("DeepGEMM is not installed here (bench/deepgemm.sh)")
    gemms = [(rows, *random_fp8(n, 1024, (128, 128), "cuda", rows), None)
             for rows, n in ((4, 1536), (64, 1536), (192, 2048))]
    deepgemm_fp8.compile_ahead(gemms, threads=3)
    for rows, weight, scale, _ in gemms:
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        x_quantized, x_scale = quantize_activation(x, token_minor=True, padded_rows=rows)
        got = deepgemm_fp8.gemm(x_quantized, x_scale, weight, scale)
        expected = fp8_reference.fp8_linear(x, weight, scale, (128, 128), quantize_input=True)
        assert relative_error(got, expected) < 2 * TOLERANCE[torch.bfloat16], rows


def test_deepgemm_in_the_tilings_the_tuner_may_choose_matches_the_reference_where_installed():
    """deepgemm_tiles: DeepGEMM's kernel in tile shapes, stage counts and multicasts of our choosing (each
    operand shared, none, tiles that end past the rows and N) gives the reference's product, compiled ahead
    on threads as a worker's start compiles them."""
    from nanoserve_kernels import deepgemm_fp8
    from nanoserve_kernels.triton_fp8_quant import quantize_activation
    if not deepgemm_fp8.available():
        pytest.skip("DeepGEMM is not installed here (bench/deepgemm.sh)")
    weight, scale = random_fp8(2048 + 128, 1024, (128, 128), "cuda", 5)
    tilings = [(64, {"block_m": 64, "block_n": 48, "multicast": "a"}),
               (128, {"block_m": 64, "block_n": 144, "multicast": "b"}),
               (128, {"block_m": 128, "block_n": 96, "multicast": ""}),
               (192, {"block_m": 128, "block_n": 64, "multicast": "b"}),
               (256, {"block_m": 256, "block_n": 32, "multicast": "a"}),
               (256, {"block_m": 256, "block_n": 160, "multicast": ""})]
    deepgemm_fp8.compile_ahead([(rows, weight, scale, tiling) for rows, tiling in tilings], threads=6)
    for rows, tiling in tilings:
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        x_quantized, x_scale = quantize_activation(x, token_minor=True, padded_rows=rows)
        got = deepgemm_fp8.gemm(x_quantized, x_scale, weight, scale, tiling)
        expected = fp8_reference.fp8_linear(x, weight, scale, (128, 128), quantize_input=True)
        assert relative_error(got, expected) < 2 * TOLERANCE[torch.bfloat16], (rows, tiling)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """The random model as FP8 checkpoints of both formats (block: "fp8"; per channel:
    "compressed-tensors"), and each one's dequantized weights as an unquantized checkpoint."""
    root = tmp_path_factory.mktemp("fp8-kl")
    source = write_checkpoint(root / "bf16", config_json(False, KL_SHAPE, "bfloat16"),
                              random_weights(False, KL_SHAPE, KL_STD, torch.bfloat16))
    paths = {}
    for fmt in ("fp8", "compressed-tensors"):
        paths[fmt] = write_fp8_checkpoint(source, root / fmt, fmt)
        paths[f"{fmt}-dequantized"] = write_dequantized(paths[fmt], root / f"{fmt}-dequantized")
    return paths


def all_logprobs(model_dir, prompts: list[list[int]]) -> torch.Tensor:
    """Next-token log-probabilities at every position of the prompts, one prefill step of all of them
    (its 1,024 rows take the W8A8 GEMM), eagerly: [positions, vocab]."""
    runner = ModelRunner(WorkerConfig(model=str(model_dir), device="cuda", dtype="bfloat16", block_size=BLOCK_SIZE,
                                      num_kv_blocks=NUM_SEQS * SEQ_LEN // BLOCK_SIZE, max_num_seqs=NUM_SEQS,
                                      max_model_len=SEQ_LEN + 1, attention_backend="triton", enforce_eager=True))
    runner.allocate_kv_cache(NUM_SEQS * SEQ_LEN // BLOCK_SIZE)
    writer = StepWriter(BLOCK_SIZE)
    work = runner._apply(writer.request(*(writer.entry(i, p, reset=True) for i, p in enumerate(prompts))))
    rows = len(work.token_ids)
    inputs = build_step_inputs(work, runner.seqs, runner.backend, runner.last_tokens, runner.buffers, runner.sampler,
                               rows)
    with torch.inference_mode(), step_context(inputs.context):
        hidden = runner._run_model(inputs.input_ids, inputs.positions)
        return torch.log_softmax(runner.model.compute_logits(hidden[:rows]).float(), dim=-1).cpu()


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors"])
def test_w8a8_next_token_kl_is_bounded_beside_the_bf16_floor(checkpoints, fmt):
    """Block scales (Qwen's format) and per-channel scales (compressed-tensors', and --quantization fp8's)."""
    from transformers import AutoModelForCausalLM
    rng = random.Random(0)
    prompts = [[rng.randrange(151_643) for _ in range(SEQ_LEN)] for _ in range(NUM_SEQS)]
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[f"{fmt}-dequantized"], dtype=torch.float32).eval().cuda()
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor(prompts, device="cuda")).logits.float(), -1).flatten(0, 1).cpu()
    del hf
    w8a8, floor = (all_logprobs(checkpoints[name], prompts) for name in (fmt, f"{fmt}-dequantized"))

    def kl(logprobs: torch.Tensor) -> float:
        return float((reference.exp() * (reference - logprobs)).sum(-1).mean())

    result = dict(format=fmt, positions=len(reference), kl_w8a8=kl(w8a8), kl_bf16_floor=kl(floor),
                  entropy=float(-(reference.exp() * reference).sum(-1).mean()),
                  device=torch.cuda.get_device_name())
    print("\nFP8 W8A8 next-token KL:", json.dumps(result))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / f"fp8_kl_{fmt}.json").write_text(json.dumps(result, indent=2))
    assert result["positions"] >= 1000
    assert result["kl_w8a8"] < max(KL_BOUND_OVER_FLOOR * result["kl_bf16_floor"], KL_BOUND_NATS), result


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_step_graphs_replay_the_fp8_kernels_as_run_eagerly(checkpoints, kv_cache_dtype):
    """Prefill of four prompts (one step of 362 tokens: W8A8) and 12 decode steps of four rows (weight-only),
    the batch-1 decode of a fifth (the matrix-vector kernel), with graphs and without: the same tokens."""
    rng = random.Random(1)
    prompts = {i: [rng.randrange(151_643) for _ in range(length)] for i, length in enumerate((5, 40, 300, 17))}
    tokens = {}
    for eager in (True, False):
        runner = ModelRunner(WorkerConfig(model=str(checkpoints["fp8"]), device="cuda", dtype="bfloat16",
                                          block_size=BLOCK_SIZE, num_kv_blocks=128, max_num_seqs=8, max_model_len=512,
                                          attention_backend="triton", enforce_eager=eager, kv_cache_dtype=kv_cache_dtype))
        runner.allocate_kv_cache(128)
        assert (runner.graphs is None) == eager and runner.info().weight_dtype == "float8_e4m3fn"
        writer = StepWriter(BLOCK_SIZE)
        tokens[eager] = generate(runner, writer, prompts, 12), generate(runner, writer, {9: prompts[1]}, 12)
        del runner
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False]


def test_the_decode_attention_quantizing_for_the_o_projection_serves_the_unfused_tokens(tmp_path, monkeypatch):
    """A model with heads of 128 (one group each) served W8A8 at every decode batch (the table stood in:
    scaled_mm from 2 rows), through the step graphs: the decode kernel quantizes for the o projection in every
    layer of every decode step, and the tokens are those of the quantization pass (the fusion taken out)."""
    from nanoserve_kernels import fp8_linear
    from nanoserve_model import row_fusion
    from nanoserve_model.attention import Attention
    shape = dict(KL_SHAPE, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    source = write_checkpoint(tmp_path / "bf16", config_json(False, shape, "bfloat16"),
                              random_weights(False, shape, KL_STD, torch.bfloat16))
    checkpoint = write_fp8_checkpoint(source, tmp_path / "fp8", "fp8")
    table_choice = fp8_linear.choice
    monkeypatch.setattr(fp8_linear, "choice", lambda rows, weight, silu_mul=False: Fp8Choice(W8A8, SCALED_MM)
                        if rows > 1 else table_choice(rows, weight, silu_mul))
    quantized_outputs = []
    forward = Attention.forward

    def counted(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        quantized_outputs.append(isinstance(out, tuple))
        return out
    monkeypatch.setattr(Attention, "forward", counted)
    rng = random.Random(3)
    prompts = {i: [rng.randrange(151_643) for _ in range(length)] for i, length in enumerate((5, 40, 300, 17))}
    tokens = {}
    for fusions in (row_fusion.FUSED, row_fusion.FUSED - {"attention_quant"}):
        monkeypatch.setattr(row_fusion, "FUSED", fusions)
        quantized_outputs.clear()
        runner = ModelRunner(WorkerConfig(model=str(checkpoint), device="cuda", dtype="bfloat16",
                                          block_size=BLOCK_SIZE, num_kv_blocks=128, max_num_seqs=8,
                                          max_model_len=512, attention_backend="triton"))
        runner.allocate_kv_cache(128)
        tokens["attention_quant" in fusions] = generate(runner, StepWriter(BLOCK_SIZE), prompts, 12)
        assert any(quantized_outputs) == ("attention_quant" in fusions)  # the captures' decode layers
        del runner
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False]


def test_deepgemm_in_the_step_graphs_gives_the_eager_tokens_where_installed(checkpoints, monkeypatch, caplog):
    """The same with the table stood in to give DeepGEMM every batch of 2-256 rows (the decode steps): a
    worker's start compiles its kernels ahead (one line says so), and graphs and eager agree."""
    from nanoserve_kernels import deepgemm_fp8, fp8_linear
    from nanoserve_kernels.fp8_configs import DEEPGEMM
    if not deepgemm_fp8.available():
        pytest.skip("DeepGEMM is not installed here (bench/deepgemm.sh)")
    table_choice = fp8_linear.choice

    def deepgemm_up_to_256(rows: int, weight: torch.Tensor, silu_mul: bool = False) -> Fp8Choice:
        return Fp8Choice(W8A8, DEEPGEMM) if 1 < rows <= 256 else table_choice(rows, weight, silu_mul)
    monkeypatch.setattr(fp8_linear, "choice", deepgemm_up_to_256)
    rng = random.Random(2)
    prompts = {i: [rng.randrange(151_643) for _ in range(length)] for i, length in enumerate((5, 40, 300, 17))}
    tokens = {}
    for eager in (True, False):
        with caplog.at_level(logging.INFO, logger="nanoserve.worker"):
            runner = ModelRunner(WorkerConfig(model=str(checkpoints["fp8"]), device="cuda", dtype="bfloat16",
                                              block_size=BLOCK_SIZE, num_kv_blocks=128, max_num_seqs=8,
                                              max_model_len=512, attention_backend="triton", enforce_eager=eager))
        assert "DeepGEMM: " in caplog.text and " kernels ready in " in caplog.text
        runner.allocate_kv_cache(128)
        tokens[eager] = generate(runner, StepWriter(BLOCK_SIZE), prompts, 12)
        del runner
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False]
