"""Checkpoints as the Hub ships them, and none at all: sharded safetensors read through their index (only
the files and tensors it names; every tensor checked from the headers before any weight is read), and
dummy weights generated on the device from config.json alone, the same full tensors at every
tensor-parallel size."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import nanoserve_model.checkpoint
import nanoserve_model.embedding
import nanoserve_model.linear
import nanoserve_model.loader
from nanoserve_model.checkpoint import INDEX, weight_files
from nanoserve_model.loader import DUMMY_STD, load_model
from nanoserve_model.registry import read_model_config
from nanoserve_cli.demo_model import config_json, write_checkpoint
from tests.worker.families import family_model_dir
from tests.worker.worker_steps import StepWriter, cpu_runner

SHARDS = 3


@pytest.fixture(scope="module")
def tensors(tiny_model_dir) -> dict[str, torch.Tensor]:
    return load_file(tiny_model_dir / "model.safetensors")


@pytest.fixture
def sharded(tmp_path, tensors):
    return write_checkpoint(tmp_path / "sharded", config_json(False), tensors, shards=SHARDS)


def load(path, dtype=torch.float32, load_format="auto"):
    return load_model(path, read_model_config(path), dtype, "cpu", load_format)


def parameters(m) -> dict[str, torch.Tensor]:
    return dict(m.named_parameters())


def rewrite_index(path, change) -> None:
    index = json.loads((path / INDEX).read_text())
    change(index["weight_map"])
    (path / INDEX).write_text(json.dumps(index))


def test_a_sharded_checkpoint_loads_as_the_whole_one(sharded, tiny_model_dir):
    assert len(list(sharded.glob("model-*-of-00003.safetensors"))) == SHARDS
    whole, parts = parameters(load(tiny_model_dir)), parameters(load(sharded))
    assert whole.keys() == parts.keys() and all(torch.equal(whole[n], parts[n]) for n in whole)


def test_only_the_files_the_index_names_are_opened(monkeypatch, sharded, tensors):
    """A consolidated copy beside the shards (as Mistral's repositories ship) is neither fetched nor read."""
    save_file({"tok_embeddings.weight": tensors["model.embed_tokens.weight"]}, sharded / "consolidated.safetensors")
    opened = []

    def recording_open(file, *args, **kwargs):
        opened.append(file.name)
        return real_open(file, *args, **kwargs)

    real_open = nanoserve_model.checkpoint.safe_open
    monkeypatch.setattr(nanoserve_model.checkpoint, "safe_open", recording_open)
    monkeypatch.setattr(nanoserve_model.loader, "safe_open", recording_open)
    load(sharded)
    assert set(opened) == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert weight_files(sharded) == sorted(set(opened))
    assert weight_files(tiny := family_model_dir("qwen2")) == ["*.safetensors"] and tiny.is_dir()


def test_a_tensor_the_index_does_not_name_is_missing(sharded):
    """The tensor is still in a shard file, but the index is what says what the checkpoint holds."""
    rewrite_index(sharded, lambda weight_map: weight_map.pop("model.layers.2.mlp.down_proj.weight"))
    with pytest.raises(ValueError, match=rf"{sharded / INDEX}: missing tensor\(s\) "
                                         r"'model\.layers\.2\.mlp\.down_proj\.weight'"):
        load(sharded)


def test_an_index_naming_an_absent_file_is_an_error(sharded):
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match=rf"{sharded / INDEX}: names model-00002-of-00003\.safetensors, which is "
                                         rf"not in {sharded}"):
        load(sharded)


def test_an_index_mapping_a_tensor_to_the_wrong_file_is_an_error(sharded):
    def move(weight_map):
        weight_map["model.norm.weight"] = next(f for f in sorted(set(weight_map.values()))
                                               if f != weight_map["model.norm.weight"])
    rewrite_index(sharded, move)
    with pytest.raises(ValueError, match=r"tensor 'model\.norm\.weight' is mapped to model-0000\d-of-00003\."
                                         r"safetensors, which does not hold it"):
        load(sharded)


def test_a_bad_tensor_in_the_last_file_stops_the_load_before_any_weight(monkeypatch, sharded, tensors):
    last = sharded / "model-00003-of-00003.safetensors"
    shard = load_file(last)
    name = sorted(shard)[-1]
    shard[name] = torch.zeros(3, 3)
    save_file(shard, last)
    loaded = []
    monkeypatch.setattr(nanoserve_model.loader.Target, "load", lambda self, tensor: loaded.append(tensor))
    with pytest.raises(ValueError, match=rf"model-00003-of-00003\.safetensors: tensor '{name}': shape \(3, 3\) in "
                                         r"the checkpoint, expected"):
        load(sharded)
    assert loaded == []


def test_pickled_weights_are_named_and_not_read(tmp_path, tiny_model_dir):
    shutil.copy(tiny_model_dir / "config.json", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no \*\.safetensors files \(pytorch_model\.bin and other PyTorch pickles "
                                         r"are not read: convert them to safetensors\); --load-format dummy"):
        load(tmp_path)


# --- dummy weights ---

@pytest.fixture
def config_only(tmp_path):
    """A Llama directory holding no weights (the biases and the llama3 rope on)."""
    path = tmp_path / "dummy"
    path.mkdir()
    shutil.copy(family_model_dir("llama") / "config.json", path)
    return path


def no_file_reads(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("dummy weights read a file")
    monkeypatch.setattr(nanoserve_model.checkpoint, "safe_open", refuse)
    monkeypatch.setattr(nanoserve_model.loader, "safe_open", refuse)


def test_dummy_weights_come_from_the_config_alone(monkeypatch, config_only):
    no_file_reads(monkeypatch)
    llama = load(config_only, load_format="dummy")
    again = parameters(load(config_only, load_format="dummy"))
    for name, param in parameters(llama).items():
        assert torch.equal(param, again[name]), name  # the same bytes every time
        if name.endswith(".bias"):
            assert not param.any(), name
        elif name.endswith("norm.weight"):
            assert (param == 1).all(), name
        else:
            assert param.mean().abs() < 2e-3 and abs(param.std().item() - DUMMY_STD) < 2e-3, name
    distinct = {param[:4].sum().item() for name, param in parameters(llama).items() if param.dim() == 2}
    assert len(distinct) == sum(param.dim() == 2 for param in llama.parameters())  # each tensor drawn on its own


def two_ranks(monkeypatch, path, load_format: str = "auto") -> list:
    """The model as ranks 0 and 1 of a group of two would build and load it."""
    ranks = []
    for rank in range(2):
        for module in (nanoserve_model.linear, nanoserve_model.embedding):
            monkeypatch.setattr(module, "tp_rank", lambda rank=rank: rank)
            monkeypatch.setattr(module, "tp_world_size", lambda: 2)
        ranks.append(parameters(load(path, load_format=load_format)))
    return ranks


def test_dummy_weights_are_one_model_at_every_tensor_parallel_size(monkeypatch, config_only):
    """Each rank narrows the same full tensors, as it would a checkpoint's: ranks of a group of two put
    back together are the one-rank model (so TP=2 and TP=1 can be compared on dummy weights)."""
    whole = parameters(load(config_only, load_format="dummy"))
    ranks = two_ranks(monkeypatch, config_only, "dummy")
    layer = "model.layers.1."
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):  # row-parallel: columns split
        assert torch.equal(torch.cat([r[layer + name] for r in ranks], 1), whole[layer + name])
    halves = [r[layer + "mlp.gate_up_proj.weight"].chunk(2) for r in ranks]  # gate rows, then up rows
    assert torch.equal(torch.cat([h[0] for h in halves] + [h[1] for h in halves]), whole[layer + "mlp.gate_up_proj.weight"])
    embed = "model.embed_tokens.weight"
    assert torch.equal(torch.cat([r[embed] for r in ranks]), whole[embed])


def test_biases_split_with_their_rows_and_stay_whole_after_the_sum(monkeypatch):
    """The tiny Llama's checkpoint biases every projection: a column-parallel bias is cut like its
    weight's rows, a row-parallel one (added once, after the all-reduce) is whole on every rank."""
    path = family_model_dir("llama")
    checkpoint = load_file(path / "model.safetensors")
    ranks = two_ranks(monkeypatch, path)
    layer = "model.layers.1."
    for name in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
        assert all(torch.equal(r[layer + name], checkpoint[layer + name]) for r in ranks)
    gate_up = [r[layer + "mlp.gate_up_proj.bias"].chunk(2) for r in ranks]
    assert torch.equal(torch.cat([g for g, _ in gate_up]), checkpoint[layer + "mlp.gate_proj.bias"])
    assert torch.equal(torch.cat([u for _, u in gate_up]), checkpoint[layer + "mlp.up_proj.bias"])
    q_rows = 2 * 16  # 4 heads of 16 over 2 ranks
    qkv = [r[layer + "self_attn.qkv_proj.bias"] for r in ranks]
    assert torch.equal(torch.cat([b[:q_rows] for b in qkv]), checkpoint[layer + "self_attn.q_proj.bias"])
    assert torch.equal(torch.cat([b[q_rows:q_rows + 16] for b in qkv]), checkpoint[layer + "self_attn.k_proj.bias"])
    assert torch.equal(torch.cat([b[q_rows + 16:] for b in qkv]), checkpoint[layer + "self_attn.v_proj.bias"])


def test_a_worker_serves_dummy_weights(monkeypatch, config_only):
    real_weights = cpu_runner(family_model_dir("llama")).info().model_fingerprint
    no_file_reads(monkeypatch)
    runner = cpu_runner(config_only, load_format="dummy")
    writer = StepWriter(4)
    logits = runner.step_logits(writer.request(writer.entry(1, list(range(1, 30)), reset=True)))
    assert logits.shape == (1, 151936) and logits.isfinite().all() and logits.std() > 0
    assert runner.info().model_fingerprint != real_weights  # same config.json, other weights


def test_the_flag_offers_the_loaders_formats():
    from nanoserve.flags import FLAGS
    (flag,) = [f for f in FLAGS if f.name == "--load-format"]
    assert flag.choices == nanoserve_model.loader.LOAD_FORMATS
