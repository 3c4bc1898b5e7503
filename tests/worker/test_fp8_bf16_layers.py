"""Where FP8 does not pay: fp8_configs.served_in_bf16's rule on small tables, and the layers it picks
dequantized in place (on CPU, the tiny FP8 checkpoint held in e4m3 as CUDA holds it) while the others stay
e4m3, with the memory their copies cost."""
import torch

from nanoserve_kernels.fp8_configs import DECODE_BUCKETS, served_in_bf16
from nanoserve_kernels.fp8_reference import FP8_DTYPE, dequantize_weight
from nanoserve_model.fp8_bf16_layers import serve_faster_layers_in_bf16
from tests.worker.fp8_models import tiny_fp8_dir
from tests.worker.test_fp8_weights import load

GPU = "Some GPU"


def entries(fp8_us: list[float], bf16_us: list[float]) -> dict:
    return {str(rows): dict(mode="weight_only", backend="triton", launch={}, us=fp8, bf16_us=bf16)
            for rows, fp8, bf16 in zip(DECODE_BUCKETS, fp8_us, bf16_us)}


def test_bf16_is_chosen_where_its_decode_buckets_take_less_time_in_all():
    fp8 = [10.0] * len(DECODE_BUCKETS)
    everywhere = {GPU: {"64x128": entries(fp8, [9.0] * len(DECODE_BUCKETS))}}
    assert served_in_bf16(GPU, 64, 128, tables=everywhere)
    assert not served_in_bf16("Another GPU", 64, 128, tables=everywhere)  # not measured there: FP8
    assert not served_in_bf16(GPU, 64, 128, silu_mul=True, tables=everywhere)  # gate/up is a shape of its own
    slower_in_one_large = [9.0] * (len(DECODE_BUCKETS) - 1) + [30.0]  # faster at 8 buckets, slower in all
    assert not served_in_bf16(GPU, 64, 128, tables={GPU: {"64x128": entries(fp8, slower_in_one_large)}})
    slower_at_one_row = [11.0] + [8.0] * (len(DECODE_BUCKETS) - 1)
    assert served_in_bf16(GPU, 64, 128, tables={GPU: {"64x128": entries(fp8, slower_at_one_row)}})
    partial = entries(fp8, [1.0] * len(DECODE_BUCKETS))
    del partial["32"]
    assert not served_in_bf16(GPU, 64, 128, tables={GPU: {"64x128": partial}})  # a bucket not measured
    no_bf16 = entries(fp8, [1.0] * len(DECODE_BUCKETS))
    no_bf16["1"].pop("bf16_us")
    assert not served_in_bf16(GPU, 64, 128, tables={GPU: {"64x128": no_bf16}})


def test_the_layers_measured_faster_in_bf16_are_dequantized_and_the_rest_stay_e4m3():
    """The tiny model's down projections (64 x 128) measured faster in bf16; its gate/up (256 x 64 + SiLU)
    not, though its plain 256 x 64 shape would be."""
    model = load(tiny_fp8_dir("fp8"), fp8_weights=True)
    faster, slower = [1.0] * len(DECODE_BUCKETS), [2.0] * len(DECODE_BUCKETS)
    fp8 = [1.5] * len(DECODE_BUCKETS)
    tables = {GPU: {"64x128": entries(fp8, faster), "256x64+silu": entries(fp8, slower),
                    "256x64": entries(fp8, faster)}}
    layers = model.model.layers
    before = [(layer.mlp.down_proj.weight.clone(), layer.mlp.down_proj.weight_scale.clone()) for layer in layers]
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    expected = [layer.mlp.down_proj(x) for layer in layers]
    served = serve_faster_layers_in_bf16(model, GPU, torch.float32, tables)
    assert served.names == tuple(f"model.layers.{i}.mlp.down_proj" for i in range(len(layers)))
    assert served.fp8_layers == 4 * len(layers)  # q/k/v, o, gate/up, down
    e4m3_bytes = sum(weight.numel() + scale.nbytes for weight, scale in before)
    assert served.extra_bytes == sum(weight.numel() * 4 for weight, _ in before) - e4m3_bytes
    for layer, (weight, scale), want in zip(layers, before, expected):
        down = layer.mlp.down_proj
        assert down.weight.dtype == torch.float32 and down.weight_scale is None and down.weight_block is None
        assert torch.equal(down.weight, dequantize_weight(weight, scale, (16, 16)))
        assert torch.allclose(down(x), want, atol=1e-6)
        assert layer.mlp.gate_up_proj.weight.dtype == FP8_DTYPE and layer.self_attn.o_proj.weight.dtype == FP8_DTYPE
    assert f"{len(layers)} of {4 * len(layers)}" in served.describe()
    assert "64x128" in served.log_line(GPU) and "MiB" in served.log_line(GPU)
