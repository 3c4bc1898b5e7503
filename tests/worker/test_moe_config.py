"""A Qwen3-MoE checkpoint as the worker reads it, before and while its weights load: the experts'
config fields with transformers' defaults, an error naming the field for what nanoserve cannot serve
(raised before any weight is read), each expert's tensors stacked per layer and split per rank, and
dummy weights at a MoE shape."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import nanoserve_model.moe
from nanoserve_cli.demo_model import TINY_MOE, config_json, random_weights, write_checkpoint
from nanoserve_model.config import ConfigError
from nanoserve_model.loader import load_model, load_weights
from nanoserve_model.moe_config import MoeConfig
from nanoserve_model.qwen3_moe import Qwen3MoeForCausalLM
from nanoserve_model.registry import read_model_config
from tests.worker.worker_steps import StepWriter, cpu_runner

LAYER = "model.layers.1.mlp."


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("moe"), config_json(False, TINY_MOE, family="qwen3_moe"),
                            random_weights(False, TINY_MOE, family="qwen3_moe"))


def write_config(path, **change):
    config = config_json(False, TINY_MOE, family="qwen3_moe") | change
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))
    return path


def test_the_experts_fields_take_transformers_defaults(tmp_path):
    moe = read_model_config(write_config(tmp_path, norm_topk_prob=..., decoder_sparse_step=...,
                                         mlp_only_layers=...)).moe
    assert moe == MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    assert [moe.is_sparse(i) for i in range(3)] == [True, True, True]
    moe = read_model_config(write_config(tmp_path, decoder_sparse_step=2, mlp_only_layers=[3])).moe
    assert [moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]


@pytest.mark.parametrize("change, message", [
    (dict(shared_expert_intermediate_size=256), r"`shared_expert_intermediate_size` is 256: a shared expert "
                                                r"\(Qwen2-MoE\) is not supported"),
    (dict(num_experts_per_tok=9), r"`num_experts_per_tok` 9 exceeds `num_experts` 8"),
    (dict(num_experts_per_tok=0), r"`num_experts_per_tok` is 0: it must be an integer of at least 1"),
    (dict(moe_intermediate_size=...), r"`moe_intermediate_size` is missing"),
    (dict(decoder_sparse_step=0), r"`decoder_sparse_step` is 0: it must be an integer of at least 1"),
    (dict(mlp_only_layers="0,1"), r"`mlp_only_layers` '0,1' is not a list of layer indices"),
])
def test_what_cannot_be_served_is_named_before_any_weight_is_read(tmp_path, change, message):
    """The weights file is not even a safetensors file: the config's error comes first."""
    write_config(tmp_path, **change)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match=message) as info:
        cpu_runner(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)


def test_a_missing_expert_tensor_is_named(tmp_path, moe_dir):
    shutil.copy(moe_dir / "config.json", tmp_path / "config.json")
    tensors = load_file(moe_dir / "model.safetensors")
    del tensors[LAYER + "experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor\(s\) 'model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight'"):
        load_weights(Qwen3MoeForCausalLM(read_model_config(tmp_path)), tmp_path)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_each_rank_keeps_its_share_of_every_expert(monkeypatch, moe_dir, world_size):
    """Gate and up split by rows, down by columns, the router whole: put back together, the checkpoint."""
    checkpoint, config = load_file(moe_dir / "model.safetensors"), read_model_config(moe_dir)
    layers = []
    for rank in range(world_size):
        monkeypatch.setattr(nanoserve_model.moe, "tp_rank", lambda rank=rank: rank)
        monkeypatch.setattr(nanoserve_model.moe, "tp_world_size", lambda: world_size)
        layers.append(load_model(moe_dir, config, torch.float32, "cpu").model.layers[1].mlp)
    rows = TINY_MOE["moe_intermediate_size"] // world_size
    for e in range(TINY_MOE["num_experts"]):
        for part, name in enumerate(("gate_proj", "up_proj")):
            assert torch.equal(torch.cat([layer.experts.gate_up_proj[e, part * rows:(part + 1) * rows]
                                          for layer in layers]), checkpoint[LAYER + f"experts.{e}.{name}.weight"])
        assert torch.equal(torch.cat([layer.experts.down_proj[e] for layer in layers], dim=1),
                           checkpoint[LAYER + f"experts.{e}.down_proj.weight"])
    assert all(torch.equal(layer.gate.weight, checkpoint[LAYER + "gate.weight"]) for layer in layers)


def test_an_expert_width_that_cannot_be_split_is_named(monkeypatch, moe_dir):
    monkeypatch.setattr(nanoserve_model.moe, "tp_world_size", lambda: 3)
    with torch.device("meta"), pytest.raises(ValueError, match=r"expert intermediate size \(moe_intermediate_size\) "
                                                               r"\(32\) is not divisible by the tensor-parallel size"):
        Qwen3MoeForCausalLM(read_model_config(moe_dir))


def test_dummy_weights_at_a_moe_shape_give_every_expert_its_own(tmp_path):
    """16 experts top-4 in every second layer, no weights on disk: every expert distinct, the step finite."""
    shape = TINY_MOE | dict(num_hidden_layers=4, num_experts=16, num_experts_per_tok=4, decoder_sparse_step=2)
    write_checkpoint(tmp_path, config_json(False, shape, family="qwen3_moe"), None)
    runner = cpu_runner(tmp_path, load_format="dummy")
    experts = runner.model.model.layers[3].mlp.experts.gate_up_proj
    assert experts.std().item() == pytest.approx(0.02, rel=0.1)
    assert len({experts[e].sum().item() for e in range(16)}) == 16
    assert not hasattr(runner.model.model.layers[2].mlp, "experts")
    writer = StepWriter(runner.config.block_size)
    logits = runner.step_logits(writer.request(writer.entry(0, list(range(100, 130)), reset=True)))
    assert logits.shape == (1, shape["vocab_size"]) and logits.isfinite().all()
