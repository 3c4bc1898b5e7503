"""A block-FP8 Qwen3-MoE checkpoint through the loader on CPU: every expert's e4m3 matrices and scales
stacked per layer and split per rank as e4m3 storage (what CUDA holds) keeps them, their dequantized
values (what CPU holds) those of an independent dequantization, the routers unquantized; logits equal to
transformers' on the dequantized weights; --quantization fp8 and dummy weights quantize the experts as
they load; a tensor-parallel size that splits a scale block, or a checkpoint that quantizes only some of
a layer's experts, refused in one line before any weight is read."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import nanoserve_model.embedding
import nanoserve_model.fp8_plan
import nanoserve_model.linear
import nanoserve_model.moe
from nanoserve_kernels.fp8_reference import FP8_DTYPE
from nanoserve_model.loader import load_model
from nanoserve_model.quantization import serving_scheme
from nanoserve_model.registry import read_model_config
from tests.worker.fp8_models import TINY_BLOCK, dequantize
from tests.worker.moe_models import hf_model, moe_model
from tests.worker.test_model_vs_hf import assert_close, hf_logits, random_prompt
from tests.worker.worker_steps import StepWriter, cpu_runner

EXPERTS = "model.layers.1.mlp.experts"
PROMPTS = [random_prompt(n, 60 + n) for n in (3, 19)]


@pytest.fixture(scope="module")
def fp8_moe():
    """The top-2 variant's block-FP8 copy (16 x 16 blocks) and transformers on its dequantized weights."""
    return moe_model("top2", lambda hf: {str(i): p for i, p in enumerate(PROMPTS)}, fp8=True)


def load(path, quantization="auto", **kwargs):
    config = read_model_config(path)
    return load_model(path, config, torch.float32, "cpu", quantization=serving_scheme(quantization,
                                                                                      config.quantization), **kwargs)


def as_ranks(monkeypatch, rank: int, world_size: int) -> None:
    """The model built as this rank of that many would build it."""
    for module in (nanoserve_model.linear, nanoserve_model.embedding, nanoserve_model.moe):
        monkeypatch.setattr(module, "tp_rank", lambda: rank)
        monkeypatch.setattr(module, "tp_world_size", lambda: world_size)
    monkeypatch.setattr(nanoserve_model.fp8_plan, "tp_world_size", lambda: world_size)


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_rank_holds_its_share_of_every_experts_e4m3_values_and_scales(monkeypatch, fp8_moe, world_size):
    """Gate and up by rows, down by columns, each with its blocks' scales: put back together, the checkpoint."""
    path = fp8_moe[0]
    checkpoint = load_file(path / "model.safetensors")
    parts = []
    for rank in range(world_size):
        as_ranks(monkeypatch, rank, world_size)
        parts.append(load(path, fp8_weights=True).model.layers[1].mlp)
    assert parts[0].gate.weight.dtype == torch.float32  # the router as the checkpoint has it
    rows, blocks = 32 // world_size, 32 // world_size // TINY_BLOCK[0]
    for e in range(8):
        for part, name in enumerate(("gate_proj", "up_proj")):
            tensor = f"{EXPERTS}.{e}.{name}.weight"
            values = torch.cat([p.experts.gate_up_proj[e, part * rows:(part + 1) * rows] for p in parts])
            scales = torch.cat([p.experts.gate_up_proj_scale[e, part * blocks:(part + 1) * blocks] for p in parts])
            assert values.dtype == FP8_DTYPE and torch.equal(values.float(), checkpoint[tensor].float())
            assert torch.equal(scales, checkpoint[tensor + "_scale_inv"])
        tensor = f"{EXPERTS}.{e}.down_proj.weight"
        assert torch.equal(torch.cat([p.experts.down_proj[e] for p in parts], dim=1).float(), checkpoint[tensor].float())
        assert torch.equal(torch.cat([p.experts.down_proj_scale[e] for p in parts], dim=1),
                           checkpoint[tensor + "_scale_inv"])


def test_on_cpu_the_experts_load_dequantized(fp8_moe):
    path = fp8_moe[0]
    checkpoint = load_file(path / "model.safetensors")
    experts = load(path).model.layers[1].mlp.experts
    assert experts.gate_up_proj_scale is None and experts.gate_up_proj.dtype == torch.float32
    for e in range(8):
        gate, up, down = (dequantize(checkpoint[f"{EXPERTS}.{e}.{name}.weight"],
                                     checkpoint[f"{EXPERTS}.{e}.{name}.weight_scale_inv"], TINY_BLOCK)
                          for name in ("gate_proj", "up_proj", "down_proj"))
        assert torch.equal(experts.gate_up_proj[e], torch.cat([gate, up])) and torch.equal(experts.down_proj[e], down)


def test_the_logits_are_transformers_on_the_dequantized_weights(fp8_moe):
    path, hf, _ = fp8_moe
    writer = StepWriter(4)
    logits = cpu_runner(path).step_logits(writer.request(*(writer.entry(i, p, reset=True)
                                                           for i, p in enumerate(PROMPTS))))
    for row, prompt in zip(logits, PROMPTS):
        assert_close(row, hf_logits(hf, prompt)[-1])


def test_quantization_fp8_quantizes_every_expert_per_channel(fp8_moe):
    """--quantization fp8 of the unquantized checkpoint: e4m3 experts with a scale per row of each matrix."""
    source = fp8_moe[0].with_name(fp8_moe[0].name.removesuffix("-fp8"))
    experts = load(source, "fp8", fp8_weights=True).model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8_DTYPE
    assert experts.gate_up_proj_scale.shape == (8, 64, 1) and experts.down_proj_scale.shape == (8, 64, 1)
    weight = load_file(source / "model.safetensors")[f"{EXPERTS}.3.down_proj.weight"]
    dequantized = experts.down_proj[3].float() * experts.down_proj_scale[3]
    assert ((dequantized - weight).abs() <= weight.abs() / 16 + 1e-6).all() and not torch.equal(dequantized, weight)


def test_dummy_weights_make_e4m3_experts_and_scales(tmp_path, fp8_moe):
    shutil.copy(fp8_moe[0] / "config.json", tmp_path / "config.json")
    experts = load(tmp_path, load_format="dummy", fp8_weights=True).model.layers[2].mlp.experts
    assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.gate_up_proj_scale.shape == (8, 4, 4)
    dequantized = experts.dequantized(torch.float32)[0]
    assert dequantized.std().item() == pytest.approx(0.02, rel=0.1)
    assert len({dequantized[e].sum().item() for e in range(8)}) == 8


def unreadable_copy(tmp_path, source, change: dict | None = None):
    """The checkpoint's config (its quantization_config changed) beside a weights file that is not one."""
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] |= change or {}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    return tmp_path


def test_a_tensor_parallel_size_that_splits_an_experts_block_is_refused_before_any_read(monkeypatch, tmp_path,
                                                                                       fp8_moe):
    """Four ranks hold 8 of each expert's 32 rows: half a 16-row block."""
    as_ranks(monkeypatch, 1, 4)
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.experts\.0\.gate_proj: this rank holds its rows "
                                         r"8\.\.16 of 32 \(tensor-parallel size 4\), which split a 16-row scale "
                                         r"block \(weight_block_size \[16, 16\]\)") as error:
        load(unreadable_copy(tmp_path, fp8_moe[0]))
    assert "\n" not in str(error.value)


def test_a_layer_whose_experts_are_quantized_only_in_part_is_refused(tmp_path, fp8_moe):
    path = unreadable_copy(tmp_path, fp8_moe[0], dict(modules_to_not_convert=[f"{EXPERTS}.5.up_proj"]))
    with pytest.raises(ValueError, match=rf"^{EXPERTS}: the quantization_config leaves {EXPERTS}\.5\.up_proj "
                                         rf"unquantized but not the rest of {EXPERTS}\.0\.gate_proj, "
                                         rf"{EXPERTS}\.0\.up_proj, {EXPERTS}\.0\.down_proj and 21 more"):
        load(path)
