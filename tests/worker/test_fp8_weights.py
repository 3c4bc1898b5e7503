"""FP8 weights through the loader on CPU: both checkpoint formats dequantize to the source within e4m3
rounding; e4m3 storage (what CUDA holds) keeps the checkpoint's bytes and scales, each rank its slice;
--quantization fp8 and dummy weights quantize as they load; what cannot be served is refused in one line
before any weight is read."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import nanoserve_model.embedding
import nanoserve_model.fp8_plan
import nanoserve_model.linear
from nanoserve_kernels.fp8_reference import FP8_DTYPE, FP8_MAX
from nanoserve_model.config import ConfigError, ModelConfig
from nanoserve_model.loader import load_model
from nanoserve_model.quantization import serving_scheme
from tests.worker.fp8_models import FORMATS, TINY_BLOCK, dequantize, tiny_fp8_dir

LAYER = "model.layers.1."
PROJECTIONS = {"self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", 64),
               "self_attn.v_proj": ("qkv_proj", 96), "mlp.gate_proj": ("gate_up_proj", 0),
               "mlp.up_proj": ("gate_up_proj", 128)}  # checkpoint module -> (our packed module, first row)


def load(path, **kwargs):
    config = ModelConfig.from_dir(path)
    return load_model(path, config, torch.float32, "cpu", quantization=config.quantization, **kwargs)


def packed_rows(model, module: str, rows: int) -> torch.Tensor:
    ours, first = PROJECTIONS[module]
    parent = model.model.layers[1].self_attn if module.startswith("self_attn") else model.model.layers[1].mlp
    return getattr(parent, ours).weight[first:first + rows]


def within_e4m3_rounding(loaded: torch.Tensor, source: torch.Tensor, scale_floor: float) -> bool:
    """Round to nearest with 3 mantissa bits: off by at most 1/16 of the value, or, in e4m3's subnormals,
    half its smallest step (2^-9 times the block's scale)."""
    return bool(((loaded - source).abs() <= source.abs() / 16 + scale_floor * 2.0 ** -10 + 1e-12).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_fp8_checkpoint_loads_dequantized_within_e4m3_rounding(tiny_model_dir, fmt):
    source = load_file(tiny_model_dir / "model.safetensors")
    model = load(tiny_fp8_dir(fmt))
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32  # CPU: dequantized at load
    for module in PROJECTIONS:
        expected = source[f"{LAYER}{module}.weight"]
        floor = float(expected.abs().max()) / FP8_MAX
        loaded = packed_rows(model, module, len(expected))
        assert within_e4m3_rounding(loaded, expected, floor) and not torch.equal(loaded, expected)
    down = source[LAYER + "mlp.down_proj.weight"]
    assert within_e4m3_rounding(model.model.layers[1].mlp.down_proj.weight, down, float(down.abs().max()) / FP8_MAX)
    assert torch.equal(model.lm_head.weight, source["lm_head.weight"])  # never quantized
    assert torch.equal(model.model.embed_tokens.weight, source["model.embed_tokens.weight"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("world_size", [1, 2])
def test_e4m3_storage_keeps_the_checkpoint_bytes_each_rank_its_slice(monkeypatch, fmt, world_size):
    path = tiny_fp8_dir(fmt)
    stored = load_file(path / "model.safetensors")
    scale_name = "weight_scale_inv" if fmt == "fp8" else "weight_scale"
    ranks = []
    for rank in range(world_size):
        for module in (nanoserve_model.linear, nanoserve_model.embedding):
            monkeypatch.setattr(module, "tp_rank", lambda rank=rank: rank)
            monkeypatch.setattr(module, "tp_world_size", lambda: world_size)
        ranks.append(load(path, fp8_weights=True))
    down = [r.model.layers[1].mlp.down_proj for r in ranks]  # row-parallel: columns split
    assert all(d.weight.dtype == FP8_DTYPE for d in down)
    q, scale = stored[LAYER + "mlp.down_proj.weight"], stored[f"{LAYER}mlp.down_proj.{scale_name}"]
    assert torch.equal(torch.cat([d.weight.view(torch.uint8) for d in down], 1), q.view(torch.uint8))
    if fmt == "fp8":
        assert torch.equal(torch.cat([d.weight_scale for d in down], 1), scale.float())
    else:  # per channel: every rank holds each row's scale
        assert all(torch.equal(d.weight_scale, scale.float()) for d in down)
    gate_up = [r.model.layers[1].mlp.gate_up_proj for r in ranks]  # column-parallel, packed
    gate = stored[LAYER + "mlp.gate_proj.weight"]
    rows = gate.shape[0] // world_size
    assert torch.equal(torch.cat([g.weight[:rows].view(torch.uint8) for g in gate_up]), gate.view(torch.uint8))
    block_rows = TINY_BLOCK[0] if fmt == "fp8" else 1
    gate_scale = torch.cat([g.weight_scale[:rows // block_rows] for g in gate_up])
    assert torch.equal(gate_scale, stored[f"{LAYER}mlp.gate_proj.{scale_name}"].float())


def test_e4m3_layers_compute_what_their_dequantized_weights_do():
    """The e4m3 layers' forward (on CPU, the FP8 kernels' reference) against the dequantized model's."""
    path = tiny_fp8_dir("fp8")
    fp8, plain = load(path, fp8_weights=True), load(path)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(fp8.model.layers[0].mlp.down_proj(x), plain.model.layers[0].mlp.down_proj(x), atol=1e-5)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(fp8.model.layers[1].self_attn.qkv_proj(hidden), plain.model.layers[1].self_attn.qkv_proj(hidden),
                          atol=1e-5)


def test_quantization_fp8_quantizes_an_unquantized_checkpoint_per_channel(tiny_model_dir):
    config = ModelConfig.from_dir(tiny_model_dir)
    scheme = serving_scheme("fp8", config.quantization)
    model = load_model(tiny_model_dir, config, torch.float32, "cpu", quantization=scheme, fp8_weights=True)
    source = load_file(tiny_model_dir / "model.safetensors")[LAYER + "mlp.down_proj.weight"]
    down = model.model.layers[1].mlp.down_proj
    assert down.weight.dtype == FP8_DTYPE and down.weight_scale.shape == (source.shape[0], 1)
    assert torch.allclose(down.weight_scale[:, 0], source.abs().amax(dim=1) / FP8_MAX)
    assert within_e4m3_rounding(dequantize(down.weight, down.weight_scale, (1, source.shape[1])), source,
                                float(source.abs().max()) / FP8_MAX)
    assert model.lm_head.weight.dtype == torch.float32


def test_dummy_weights_of_an_fp8_config_are_e4m3_with_scales(tiny_model_dir):
    model = load(tiny_fp8_dir("fp8"), load_format="dummy", fp8_weights=True)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.shape == (128 // TINY_BLOCK[0], 64 // TINY_BLOCK[1])
    assert bool((qkv.weight_scale > 0).all()) and qkv.weight.float().abs().max() == FP8_MAX  # each block's amax


def fp8_copy(tmp_path, change: dict | None = None, tensors=None):
    """The block-FP8 tiny checkpoint with its quantization_config changed (and its tensors, if given)."""
    source = tiny_fp8_dir("fp8")
    for file in source.iterdir():
        shutil.copy(file, tmp_path / file.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] |= change or {}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors(load_file(source / "model.safetensors")), tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("change, message", [
    (dict(weight_block_size=[128]), r"weight_block_size is \[128\]; expected two positive integers"),
    (dict(activation_scheme="static"), r"activation_scheme 'static' is not supported"),
    (dict(quant_method="gptq"), r"quant_method 'gptq' is not supported"),
    (dict(fmt="e5m2"), r"fmt 'e5m2' is not supported"),
])
def test_a_quantization_config_that_cannot_be_served_is_one_line(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message) as error:
        ModelConfig.from_dir(fp8_copy(tmp_path, change))
    assert "\n" not in str(error.value) and "config.json" in str(error.value)


def unreadable_weights(tmp_path, change: dict):
    """A copy whose weights file is garbage: a refusal that names the layer came before any read."""
    path = fp8_copy(tmp_path, change)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    return path


@pytest.mark.parametrize("block, world_size, message", [
    ([48, 16], 1, r"model\.layers\.0\.self_attn\.q_proj: its 64 rows on this rank are not whole 48-row scale blocks "
                  r"\(weight_block_size \[48, 16\]\), and model\.layers\.0\.self_attn\.qkv_proj packs"),
    ([32, 32], 2, r"model\.layers\.0\.self_attn\.k_proj: this rank holds its rows 16\.\.32 of 32 \(tensor-parallel "
                  r"size 2\), which split a 32-row scale block"),
    ([16, 48], 2, r"model\.layers\.0\.self_attn\.o_proj: this rank holds its columns 32\.\.64 of 64 \(tensor-parallel "
                  r"size 2\), which split a 48-column scale block"),
])
def test_a_block_split_by_packing_or_a_rank_is_refused_before_any_read(monkeypatch, tmp_path, block, world_size,
                                                                       message):
    for module in (nanoserve_model.linear, nanoserve_model.embedding):
        monkeypatch.setattr(module, "tp_rank", lambda: world_size - 1)
        monkeypatch.setattr(module, "tp_world_size", lambda: world_size)
    monkeypatch.setattr(nanoserve_model.fp8_plan, "tp_world_size", lambda: world_size)
    with pytest.raises(ValueError, match=message) as error:
        load(unreadable_weights(tmp_path, dict(weight_block_size=block)))
    assert "\n" not in str(error.value)


def test_an_unquantized_weight_where_fp8_is_expected_is_named(tmp_path):
    def unquantize_down(tensors):
        name = LAYER + "mlp.down_proj.weight"
        return tensors | {name: tensors[name].float()}

    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight' is F32, but the "
                                         r"quantization_config \(fp8\) quantizes it to F8_E4M3"):
        load(fp8_copy(tmp_path, tensors=unquantize_down))


def test_modules_to_not_convert_stay_unquantized(tmp_path):
    """A checkpoint whose layer-0 MLP is left in float32 (listed in modules_to_not_convert)."""
    from nanoserve_cli.fp8_checkpoint import write_fp8_checkpoint
    from nanoserve_cli.cache import demo_model_dir
    ignored = ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj")
    path = write_fp8_checkpoint(demo_model_dir(tied=False), tmp_path / "partial", "fp8", TINY_BLOCK, ignored)
    model = load(path, fp8_weights=True)
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.down_proj.weight_scale is None
    assert model.model.layers[1].mlp.down_proj.weight.dtype == FP8_DTYPE
    source = load_file(demo_model_dir(tied=False) / "model.safetensors")
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, source["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_every_family_serves_its_fp8_checkpoint_as_transformers_does_its_dequantized_weights(tmp_path, family):
    """Llama with a bias on every projection, Qwen2 with its q/k/v bias, Mistral: block FP8 copies, their
    prefill logits on CPU (dequantized at load) against transformers on the dequantized weights."""
    from tests.worker.families import family_model_dir, hf_model
    from tests.worker.fp8_models import write_dequantized
    from tests.worker.test_model_vs_hf import assert_close, hf_logits
    from tests.worker.worker_steps import StepWriter, cpu_runner
    from nanoserve_cli.fp8_checkpoint import write_fp8_checkpoint
    path = write_fp8_checkpoint(family_model_dir(family), tmp_path / "fp8", "fp8", TINY_BLOCK)
    hf = hf_model(write_dequantized(path, tmp_path / "dequantized"))
    prompt = [(i * 7919) % 150_000 for i in range(11)]
    writer = StepWriter(4)
    logits = cpu_runner(path).step_logits(writer.request(writer.entry(0, prompt, reset=True)))
    assert_close(logits[0], hf_logits(hf, prompt)[-1])
