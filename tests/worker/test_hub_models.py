"""`--model` as a Hugging Face Hub id: resolved through huggingface_hub's cache (never the network here:
a cache filled by hand, read offline, and downloads replaced in-process), local directories used as they
are, and an error a person can act on for each way a Hub model cannot be had. The worker fetches the
config first and checks it, then only the weight files its loader reads."""
import shutil
from fnmatch import fnmatch
from pathlib import Path

import httpx
import huggingface_hub
import pytest
from huggingface_hub import errors
from safetensors.torch import load_file

from nanoserve_model.checkpoint import CONFIG_FILES
from nanoserve_model.config import ConfigError
from nanoserve.hub import ModelNotFound, resolve_model_dir
from nanoserve_cli.demo_model import config_json, write_checkpoint
from worker_svc.config import WorkerConfig
from worker_svc.runner import fetch_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(cache: Path, repo_id: str, source: Path) -> Path:
    """A huggingface_hub cache holding `source` as the main revision of `repo_id`, laid out as
    snapshot_download leaves it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(source, repo / "snapshots" / COMMIT)
    return repo / "snapshots" / COMMIT


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def no_downloads(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a local directory went to the Hub")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


def test_a_local_directory_is_used_as_it_is(monkeypatch, tiny_model_dir):
    no_downloads(monkeypatch)
    assert resolve_model_dir(str(tiny_model_dir), CONFIG_FILES, revision="v2") == tiny_model_dir


@pytest.mark.parametrize("name", ["./absent-model", "/no/such/dir", "~/absent-model", "a/b/c", "bad id!"])
def test_a_path_that_is_not_there_is_named(monkeypatch, name):
    no_downloads(monkeypatch)
    with pytest.raises(ModelNotFound, match=rf"model '{name}': no such directory \(a Hugging Face Hub id looks "
                                            r"like owner/name\)"):
        resolve_model_dir(name, CONFIG_FILES)


def test_a_hub_id_is_read_from_the_cache_offline(offline, tmp_path, tiny_model_dir):
    snapshot = hub_cache(tmp_path, "nanoserve-test/tiny-qwen3", tiny_model_dir)
    assert resolve_model_dir("nanoserve-test/tiny-qwen3", CONFIG_FILES, download_dir=str(tmp_path)) == snapshot


def test_a_hub_id_missing_from_the_cache_offline_says_so(offline, tmp_path):
    with pytest.raises(ModelNotFound, match=rf"model 'nanoserve-test/absent' is not in the Hugging Face cache "
                                            rf"\({tmp_path}\) and HF_HUB_OFFLINE is set: download it first"):
        resolve_model_dir("nanoserve-test/absent", CONFIG_FILES, download_dir=str(tmp_path))


def hub_error(kind: type) -> Exception:
    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/x"))
    return kind("404 Client Error", response=response)


@pytest.mark.parametrize("error, message", [
    (hub_error(errors.RepositoryNotFoundError), r"model 'owner/name': no such directory here, and no such model on "
                                                r"the Hugging Face Hub \(a private one needs HF_TOKEN\)"),
    (hub_error(errors.GatedRepoError), r"model 'owner/name' is gated on the Hugging Face Hub: accept its terms"),
    (hub_error(errors.RevisionNotFoundError), r"model 'owner/name': the Hugging Face Hub has no such revision"),
    (errors.LocalEntryNotFoundError("connection refused"), r"model 'owner/name': the Hugging Face Hub cannot be "
                                                           r"reached and the model is not in the cache"),
])
def test_each_way_a_hub_model_cannot_be_had_is_said(monkeypatch, error, message):
    def failing(*args, **kwargs):
        raise error
    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(ModelNotFound, match=message):
        resolve_model_dir("owner/name", CONFIG_FILES)


class FakeHub:
    """snapshot_download over a 'remote' directory: copies the files the patterns match into one snapshot
    and records each call's patterns."""

    def __init__(self, remote: Path, snapshot: Path):
        self.remote, self.snapshot, self.calls = remote, snapshot, []

    def __call__(self, repo_id: str, revision=None, cache_dir=None, allow_patterns=None) -> str:
        self.calls.append((repo_id, revision, cache_dir, sorted(allow_patterns)))
        self.snapshot.mkdir(exist_ok=True)
        for file in self.remote.iterdir():
            if any(fnmatch(file.name, pattern) for pattern in allow_patterns):
                shutil.copy(file, self.snapshot)
        return str(self.snapshot)


@pytest.fixture
def remote(tmp_path, tiny_model_dir) -> Path:
    """A sharded Hub repository that also ships a consolidated copy of its weights."""
    path = write_checkpoint(tmp_path / "remote", config_json(False), load_file(tiny_model_dir / "model.safetensors"),
                            shards=2)
    shutil.copy(tiny_model_dir / "model.safetensors", path / "consolidated.safetensors")
    return path


def test_the_worker_fetches_the_config_then_only_the_indexed_weights(monkeypatch, tmp_path, remote):
    hub = FakeHub(remote, tmp_path / "snapshot")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    config = WorkerConfig(model="owner/tiny", revision="v1.0", download_dir=str(tmp_path / "hub"))
    path, model_config = fetch_checkpoint(config)
    assert path == hub.snapshot and model_config.architecture == "Qwen3ForCausalLM"
    assert hub.calls == [
        ("owner/tiny", "v1.0", str(tmp_path / "hub"), sorted(CONFIG_FILES)),
        ("owner/tiny", "v1.0", str(tmp_path / "hub"), ["model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors"]),
    ]
    assert not (path / "consolidated.safetensors").exists() and not (path / "tokenizer.json").exists()


def test_dummy_weights_fetch_no_weights(monkeypatch, tmp_path, remote):
    hub = FakeHub(remote, tmp_path / "snapshot")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    fetch_checkpoint(WorkerConfig(model="owner/tiny", load_format="dummy"))
    assert [patterns for *_, patterns in hub.calls] == [sorted(CONFIG_FILES)]


def test_an_unsupported_hub_model_fails_before_its_weights_are_fetched(monkeypatch, tmp_path, remote):
    config = remote / "config.json"
    config.write_text(config.read_text().replace("Qwen3ForCausalLM", "GPT2LMHeadModel"))
    hub = FakeHub(remote, tmp_path / "snapshot")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    with pytest.raises(ConfigError, match="`architectures` 'GPT2LMHeadModel' is not supported"):
        fetch_checkpoint(WorkerConfig(model="owner/tiny"))
    assert len(hub.calls) == 1
