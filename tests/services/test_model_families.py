"""Other families and checkpoint forms through the real services: the tiny Llama (llama3 rope scaling,
a bias on every projection) split over two worker ranks, served from a Hugging Face Hub id that worker and
scheduler both resolve from the Hub cache ($HF_HOME, offline), as a sharded checkpoint whose
generation_config.json sets the default temperature; and a worker serving dummy weights from a directory
that holds no weights at all."""
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from nanoserve.client import Client
from nanoserve_cli.demo_model import write_checkpoint
from tests.services import processes
from tests.services.processes import running_service
from tests.services.test_tensor_parallel import SCHEDULER_FLAGS, WORKER_FLAGS, hf_greedy, token_prompt
from tests.worker.families import family_model_dir, hf_model
from tests.worker.test_hub_models import hub_cache

HUB_ID = "nanoserve-test/tiny-llama"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """A Hub cache holding the tiny Llama as a two-shard checkpoint whose default temperature is 0."""
    source = family_model_dir("llama")
    staged = write_checkpoint(tmp_path_factory.mktemp("staged"), json.loads((source / "config.json").read_text()),
                              load_file(source / "model.safetensors"), shards=2, generation={"temperature": 0.0})
    home = tmp_path_factory.mktemp("hf-home")
    hub_cache(home / "hub", HUB_ID, staged)
    return home


def test_a_hub_llama_over_two_ranks_generates_transformers_greedy_tokens(monkeypatch, hf_home, tmp_path):
    monkeypatch.setitem(processes.ENV, "HF_HOME", str(hf_home))
    monkeypatch.setitem(processes.ENV, "HF_HUB_OFFLINE", "1")
    hf = hf_model(family_model_dir("llama"))
    prompts = [token_prompt(n) for n in (5, 23, 100)]
    with running_service(Path(HUB_ID), tmp_path / "services.log", tensor_parallel_size=2, worker_flags=WORKER_FLAGS,
                         scheduler_flags=SCHEDULER_FLAGS) as svc, Client(svc["address"]) as client:
        assert client.model_info().model == HUB_ID
        for prompt in prompts:  # no temperature in the request: the model's default, 0, applies
            assert client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids == hf_greedy(
                hf, prompt, MAX_TOKENS)
        text = "The quick brown fox"
        assert client.generate(text, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids == hf_greedy(
            hf, client.tokenize(text), MAX_TOKENS)  # the scheduler found the tokenizer through the Hub cache too


def test_dummy_weights_serve_from_a_directory_without_weights(tmp_path):
    model_dir = tmp_path / "config-only"
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(family_model_dir("qwen2") / name, model_dir)
    with running_service(model_dir, tmp_path / "services.log", worker_flags=("--load-format", "dummy")) as svc, \
            Client(svc["address"]) as client:
        result = client.generate("Benchmark any shape", max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)
        assert len(result.token_ids) == 8
    assert "(Qwen2ForCausalLM, dummy weights)" in (tmp_path / "services.log").read_text()
