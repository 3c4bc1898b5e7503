"""A decode step's attention writing its output quantized for the o projection (nanoserve_model/attention.py):
which steps and backends do, the buffer it hands the kernel (the layout the o projection's GEMM asked for),
and what the others return. The backend's decode is stood in: the Triton kernel's own check is the
interpreter's (tests/worker/test_triton_kernels.py) and the GPU's (tests/gpu/test_fp8_weights_gpu.py)."""
import pytest
import torch

from nanoserve_kernels.backend import AttentionBackend
from nanoserve_model.attention import Attention
from nanoserve_model.step_context import StepContext, step_context

ROWS, HEADS, KV_HEADS = 3, 4, 2
LAYOUT = dict(token_minor=True, padded_rows=8)


def decode_context(backend_name: str, calls: list, is_prefill: bool = False) -> StepContext:
    def paged_decode(q, *args, **kwargs):
        calls.append(kwargs)
        return kwargs.get("quantized_out", torch.zeros_like(q))
    backend = AttentionBackend(backend_name, store_kvcache=None, paged_decode=paged_decode,
                               paged_prefill=lambda q, *args, **kwargs: torch.zeros_like(q))
    lens = torch.full((ROWS,), 5, dtype=torch.int32)
    return StepContext(backend=backend, is_prefill=is_prefill, slot_mapping=torch.arange(ROWS), context_lens=lens,
                       block_tables=torch.zeros(ROWS, 1, dtype=torch.int32),
                       cu_seqlens_q=torch.arange(ROWS + 1, dtype=torch.int32),
                       cu_seqlens_k=torch.arange(0, 5 * ROWS + 1, 5, dtype=torch.int32), max_seqlen_q=1,
                       max_seqlen_k=5)


def attend(context: StepContext, head_dim: int, quantization: dict | None):
    q = torch.randn(ROWS, HEADS, head_dim)
    k, v = torch.randn(2, ROWS, KV_HEADS, head_dim).unbind(0)
    with step_context(context):
        return Attention(HEADS, KV_HEADS, head_dim)(q, k, v, stored=True, quantization=quantization)


def test_a_triton_decode_step_returns_its_output_quantized_in_the_layout_asked():
    calls = []
    quantized, scales = attend(decode_context("triton", calls), 128, LAYOUT)
    assert calls[0]["quantized_out"][0] is quantized
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == (8, HEADS * 128)
    assert scales.shape == (8, HEADS) and scales.stride() == (1, 8)  # a head a group, token-minor, padded


@pytest.mark.parametrize("backend, head_dim, is_prefill, quantization", [
    ("triton", 128, False, None),  # the o projection takes 16-bit activations (bf16 weights, or one row)
    ("triton", 64, False, LAYOUT),  # a head is not one group of 128 columns
    ("torch", 128, False, LAYOUT),  # a backend whose decode does not quantize
    ("triton", 128, True, LAYOUT),  # a prefill or mixed step: the prefill kernel writes most rows
])
def test_other_steps_return_the_16_bit_output(backend: str, head_dim: int, is_prefill: bool, quantization):
    calls = []
    out = attend(decode_context(backend, calls, is_prefill), head_dim, quantization)
    assert isinstance(out, torch.Tensor) and out.shape == (ROWS, HEADS, head_dim)
    assert all("quantized_out" not in kwargs for kwargs in calls)
