"""The safetensors loader: q/k/v and gate/up packed into their merged weights (and, under tensor
parallelism, each rank keeping its own slice), and a clear error naming any tensor that is
missing, unexpected or mis-shaped."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import nanoserve_model.embedding
import nanoserve_model.linear
from nanoserve_model.loader import load_model, load_weights
from nanoserve_model.qwen3 import Qwen3ForCausalLM
from nanoserve_model.config import ModelConfig

LAYER = "model.layers.1."


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir) -> dict[str, torch.Tensor]:
    return load_file(tiny_model_dir / "model.safetensors")


def test_packed_weights_hold_the_checkpoint_tensors(tiny_model_dir, checkpoint):
    qwen = load_model(tiny_model_dir, ModelConfig.from_dir(tiny_model_dir), torch.float32, "cpu")
    layer = qwen.model.layers[1]
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(
        [checkpoint[LAYER + f"self_attn.{name}_proj.weight"] for name in "qkv"]))
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(
        [checkpoint[LAYER + f"mlp.{name}_proj.weight"] for name in ("gate", "up")]))
    assert torch.equal(qwen.lm_head.weight, checkpoint["lm_head.weight"])


def test_tied_checkpoint_shares_the_embedding(tiny_tied_model_dir):
    qwen = load_model(tiny_tied_model_dir, ModelConfig.from_dir(tiny_tied_model_dir), torch.bfloat16, "cpu")
    assert qwen.lm_head.weight is qwen.model.embed_tokens.weight
    assert qwen.lm_head.weight.dtype == torch.bfloat16


def broken_checkpoint(tmp_path, tiny_model_dir, checkpoint, change) -> Qwen3ForCausalLM:
    """A copy of the tiny checkpoint with `change` applied to its tensors, and an empty model for it."""
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    tensors = dict(checkpoint)
    change(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    return Qwen3ForCausalLM(ModelConfig.from_dir(tmp_path))


def test_missing_tensor_is_named(tmp_path, tiny_model_dir, checkpoint):
    qwen = broken_checkpoint(tmp_path, tiny_model_dir, checkpoint, lambda t: t.pop(LAYER + "self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        load_weights(qwen, tmp_path)


def test_unexpected_tensor_is_named(tmp_path, tiny_model_dir, checkpoint):
    def add(tensors):
        tensors[LAYER + "mlp.extra_proj.weight"] = torch.zeros(4, 4)
    qwen = broken_checkpoint(tmp_path, tiny_model_dir, checkpoint, add)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.1\.mlp\.extra_proj\.weight'"):
        load_weights(qwen, tmp_path)


def test_misshaped_tensor_is_named(tmp_path, tiny_model_dir, checkpoint):
    def truncate(tensors):
        tensors[LAYER + "mlp.up_proj.weight"] = tensors[LAYER + "mlp.up_proj.weight"][:100].clone()
    qwen = broken_checkpoint(tmp_path, tiny_model_dir, checkpoint, truncate)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight': shape \(100, 64\) in the "
                                         r"checkpoint, expected \(128, 64\)"):
        load_weights(qwen, tmp_path)


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_loads_its_own_shard(monkeypatch, tiny_model_dir, checkpoint, world_size):
    """Ranks built as if in a group of `world_size` (4 ranks: each of the 2 KV heads replicated on
    the 2 ranks whose query heads use it); their slices put back together are the checkpoint."""
    config = ModelConfig.from_dir(tiny_model_dir)
    ranks = []
    for rank in range(world_size):
        for module in (nanoserve_model.linear, nanoserve_model.embedding):
            monkeypatch.setattr(module, "tp_rank", lambda rank=rank: rank)
            monkeypatch.setattr(module, "tp_world_size", lambda: world_size)
        qwen = Qwen3ForCausalLM(config)
        load_weights(qwen, tiny_model_dir)
        ranks.append(qwen)
    head_dim, kv_heads = config.head_dim, config.num_key_value_heads
    q_rows = config.num_attention_heads * head_dim // world_size
    kv_rows = max(1, kv_heads // world_size) * head_dim

    def gathered(name: str, dim: int = 0) -> torch.Tensor:
        return torch.cat([dict(r.named_parameters())[name] for r in ranks], dim=dim)

    qkv = [r.model.layers[1].self_attn.qkv_proj.weight for r in ranks]
    assert torch.equal(torch.cat([w[:q_rows] for w in qkv]), checkpoint[LAYER + "self_attn.q_proj.weight"])
    for offset, name in ((q_rows, "k"), (q_rows + kv_rows, "v")):
        full = checkpoint[LAYER + f"self_attn.{name}_proj.weight"]
        rank_kv = torch.stack([w[offset:offset + kv_rows] for w in qkv])
        if world_size <= kv_heads:
            assert torch.equal(torch.cat(list(rank_kv)), full)
        else:  # rank r holds KV head r // (world_size / kv_heads)
            assert torch.equal(rank_kv, full.view(kv_heads, head_dim, -1).repeat_interleave(world_size // kv_heads, 0))
    assert torch.equal(gathered(LAYER + "self_attn.o_proj.weight", dim=1), checkpoint[LAYER + "self_attn.o_proj.weight"])
    assert torch.equal(gathered(LAYER + "mlp.down_proj.weight", dim=1), checkpoint[LAYER + "mlp.down_proj.weight"])
    gate_up = [r.model.layers[1].mlp.gate_up_proj.weight.chunk(2) for r in ranks]
    assert torch.equal(torch.cat([g for g, _ in gate_up]), checkpoint[LAYER + "mlp.gate_proj.weight"])
    assert torch.equal(torch.cat([u for _, u in gate_up]), checkpoint[LAYER + "mlp.up_proj.weight"])
    assert torch.equal(gathered("model.embed_tokens.weight"), checkpoint["model.embed_tokens.weight"])
    assert torch.equal(gathered("lm_head.weight"), checkpoint["lm_head.weight"])
    assert torch.equal(ranks[-1].model.norm.weight, checkpoint["model.norm.weight"])  # replicated
