"""Tensor parallelism on CPU (gloo): two worker ranks serve the tiny model, whose 2 KV heads are split
across the ranks, and a variant with 1 KV head, which both ranks hold. Checked against transformers
through the real services and, for logits, through two runners driven by hand; then the faults of a
group: a rank missing at start-up, a rank dying mid-stream or while idle."""
import dataclasses
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open

import nanoserve_model.embedding
import nanoserve_model.linear
import nanoserve_model.loader
from nanoserve_model.loader import load_weights
from nanoserve_model.qwen3 import Qwen3ForCausalLM
from nanoserve_model.config import ModelConfig
from nanoserve.client import Client
from nanoserve_cli.cache import cache_dir
from nanoserve_cli.demo_model import SHAPE, config_json, random_weights, write_checkpoint
from tests.services.processes import (free_port, health_status, running_service, start_scheduler, start_worker, stop,
                            wait_answering, wait_serving)
from tests.worker.worker_steps import StepWriter
from worker_svc.config import WorkerConfig
from worker_svc.runner import ModelRunner

NOT_SERVING = "NOT_SERVING"
BLOCK_SIZE, NUM_KV_BLOCKS = 16, 64
WORKER_FLAGS = ("--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(NUM_KV_BLOCKS))
# Prompts of more than 64 tokens are prefilled in chunks.
SCHEDULER_FLAGS = ("--max-num-seqs", "16", "--max-num-batched-tokens", "64")
KV1_SHAPE = SHAPE | {"num_key_value_heads": 1}  # fewer KV heads than ranks
MAX_TOKENS = 16


def token_prompt(length: int) -> list[int]:
    return [(i * 7919 + length * 131) % 150_000 for i in range(length)]


@pytest.fixture(scope="session")
def tiny_kv1_model_dir() -> Path:
    path = cache_dir() / "tiny-qwen3-kv1"
    if not (path / "model.safetensors").exists():  # written last: its presence means a whole build
        write_checkpoint(path, config_json(False, KV1_SHAPE), random_weights(False, KV1_SHAPE))
    return path


@pytest.fixture(scope="module")
def models(tiny_model_dir, tiny_tied_model_dir, tiny_kv1_model_dir) -> dict[str, Path]:
    return {"kv-split": tiny_model_dir, "tied": tiny_tied_model_dir, "kv-replicated": tiny_kv1_model_dir}


@pytest.fixture(scope="module")
def hf(models) -> dict[str, torch.nn.Module]:
    # Imported here, not at the top: the spawned ranks import this module and need no transformers.
    from transformers import AutoModelForCausalLM
    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for name, path in models.items()}


def hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0]


def hf_greedy(hf_model: torch.nn.Module, token_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([token_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(token_ids):].tolist()


@pytest.mark.parametrize("world_size, change, message", [
    (3, {}, r"vocab size \(151936\) is not divisible by the tensor-parallel size \(3\)"),
    (8, {}, r"attention heads \(4\) is not divisible by the tensor-parallel size \(8\)"),
    (4, dict(vocab_size=1024, num_attention_heads=12, num_key_value_heads=3),
     r"tensor-parallel size \(4\) is not a multiple of the KV heads \(3\)"),
    (2, dict(intermediate_size=127), r"output features \(127\) is not divisible by the tensor-parallel size"),
])
def test_a_size_that_cannot_shard_the_model_is_named(monkeypatch, tiny_model_dir, world_size, change, message):
    for module in (nanoserve_model.linear, nanoserve_model.embedding):
        monkeypatch.setattr(module, "tp_world_size", lambda: world_size)
    config = dataclasses.replace(ModelConfig.from_dir(tiny_model_dir), **change)
    with torch.device("meta"), pytest.raises(ValueError, match=message):
        Qwen3ForCausalLM(config)


def test_a_rank_reads_whole_only_the_tensors_it_keeps_whole(monkeypatch, tiny_model_dir):
    """At world size 2 every sharded tensor is read through a slice of the file; only the
    replicated norms are read whole."""
    for module in (nanoserve_model.linear, nanoserve_model.embedding):
        monkeypatch.setattr(module, "tp_rank", lambda: 1)
        monkeypatch.setattr(module, "tp_world_size", lambda: 2)
    read_whole = []

    class RecordingFile:
        def __init__(self, *args, **kwargs):
            self.file = safe_open(*args, **kwargs)

        def __enter__(self) -> "RecordingFile":
            return self

        def __exit__(self, *exc) -> None:
            self.file.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.file.keys()

        def get_slice(self, name: str):
            return self.file.get_slice(name)

        def get_tensor(self, name: str) -> torch.Tensor:
            read_whole.append(name)
            return self.file.get_tensor(name)

    monkeypatch.setattr(nanoserve_model.loader, "safe_open", RecordingFile)
    load_weights(Qwen3ForCausalLM(ModelConfig.from_dir(tiny_model_dir)), tiny_model_dir)
    assert read_whole and all(name.endswith("norm.weight") for name in read_whole), read_whole


# --- two ranks as services, through the scheduler and a gRPC client ---

@pytest.fixture(scope="module", params=["kv-split", "kv-replicated"])
def service(request, models, tmp_path_factory):
    log = tmp_path_factory.mktemp("tp") / "services.log"
    with running_service(models[request.param], log, tensor_parallel_size=2, worker_flags=WORKER_FLAGS,
                         scheduler_flags=SCHEDULER_FLAGS) as svc, Client(svc["address"]) as client:
        yield request.param, client


def test_two_ranks_generate_the_greedy_tokens_of_transformers(service, hf):
    """Concurrent requests, one long enough to be prefilled in two chunks."""
    name, client = service
    prompts = [token_prompt(n) for n in (5, 23, 100, 37)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: client.generate(p, max_tokens=MAX_TOKENS, temperature=0,
                                                          ignore_eos=True), prompts))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(hf[name], prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


def test_client_against_two_ranks(service, hf):
    name, client = service
    info = client.model_info()
    assert (info.tensor_parallel_size, info.num_kv_blocks, info.block_size) == (2, NUM_KV_BLOCKS, BLOCK_SIZE)
    text = "The quick brown fox jumps over the lazy dog."
    ids = client.tokenize(text)
    streamed = [list(msg.token_ids) for msg in client.stream(text, max_tokens=MAX_TOKENS, temperature=0,
                                                             ignore_eos=True)]
    assert sum(streamed, []) == hf_greedy(hf[name], ids, MAX_TOKENS) and len(streamed) > 1

    def sampled(seed: int) -> list[int]:  # rank 0 samples from the logits it gathered
        return client.generate(token_prompt(9), max_tokens=8, temperature=1.0, seed=seed, ignore_eos=True).token_ids

    with ThreadPoolExecutor(6) as pool:
        first, second = list(pool.map(sampled, range(3))), list(pool.map(sampled, range(3)))
    assert first == second and len({tuple(t) for t in first}) == 3
    stats = client.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total == NUM_KV_BLOCKS
    assert stats.num_running == stats.num_waiting == 0


def test_logprobs_over_two_ranks_are_transformers(service, hf):
    """Prompt positions are scored on both ranks (the vocab-parallel LM head gathers to rank 0),
    over two prefill chunks; rank 0 scores the sampled tokens, whatever the processors do."""
    name, client = service
    prompt = token_prompt(100)
    got = client.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2,
                          repetition_penalty=1.2)
    reference = torch.log_softmax(hf_logits(hf[name], prompt + got.token_ids), dim=-1)
    entries = list(enumerate(got.prompt_logprobs)) + [(len(prompt) - 1 + i, e) for i, e in enumerate(got.logprobs)]
    assert len(entries) == len(prompt) - 1 + 4
    for position, entry in entries:
        assert entry.token.logprob == pytest.approx(reference[position, entry.token.token_id].item(), abs=1e-4)
        assert [top.token_id for top in entry.top] == reference[position].topk(2).indices.tolist()


# --- two runners driven by hand: logits and KV sizing per rank ---

PROMPTS = {1: token_prompt(20), 2: token_prompt(7), 3: token_prompt(33)}
NEXT_TOKENS = {1: 4242, 2: 17, 3: 99_999}  # fed to the decode step
KV_BUDGET_GB = 0.001


def _run_rank(rank: int, port: int, models: dict[str, str], out: str) -> None:
    """One of two spawned ranks: a prefill step and a decode step on each model; saves what it got."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for name, path in models.items():
        runner = ModelRunner(WorkerConfig(model=path, device="cpu", rank=rank, tensor_parallel_size=2,
                                          block_size=BLOCK_SIZE, cpu_kv_cache_gb=KV_BUDGET_GB))
        runner.allocate_kv_cache(NUM_KV_BLOCKS)
        writer = StepWriter(BLOCK_SIZE)
        prefill = writer.request(*(writer.entry(i, prompt, reset=True) for i, prompt in PROMPTS.items()))
        decode = writer.request(*(writer.entry(i, [NEXT_TOKENS[i]], len(prompt), num_generated=1)
                                  for i, prompt in PROMPTS.items()))
        results[name] = dict(prefill=runner.step_logits(prefill), decode=runner.step_logits(decode),
                             max_kv_blocks=runner.info().max_kv_blocks, kv_heads=runner.kv_cache.shape[-2])
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_two_rank_logits_match_transformers(models, hf, tmp_path):
    mp.spawn(_run_rank, args=(free_port(), {name: str(path) for name, path in models.items()}, str(tmp_path)),
             nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    # 3 layers x block x K and V x 1 KV head per rank (2 split in two, or 1 replicated) x 16 dims x 4 bytes
    own_heads_blocks = int(KV_BUDGET_GB * 2**30 // (3 * BLOCK_SIZE * 2 * 1 * 16 * 4))
    for name, hf_model in hf.items():
        for i, (seq_id, prompt) in enumerate(PROMPTS.items()):
            reference = hf_logits(hf_model, prompt + [NEXT_TOKENS[seq_id]])
            for step, position in (("prefill", -2), ("decode", -1)):
                ours = ranks[0][name][step][i]
                error = ((ours - reference[position]).abs().max() / reference[position].abs().max()).item()
                assert error < 1e-4, f"{name}, seq {seq_id}, {step}: relative error {error:.2e}"
        assert ranks[1][name]["prefill"] is None and ranks[1][name]["decode"] is None  # only rank 0 samples
        for rank in ranks:
            assert (rank[name]["kv_heads"], rank[name]["max_kv_blocks"]) == (1, own_heads_blocks), name


# --- faults ---

def port_of(proc) -> str:
    return proc.args[proc.args.index("--port") + 1]


def test_missing_rank_is_waited_for_then_reported(tiny_model_dir, tmp_path):
    """Rank 1 never starts: rank 0 waits for its group, the scheduler reports the group unavailable
    and gives up after its connect timeout; once rank 1 comes, a scheduler gets the whole group."""
    log = tmp_path / "services.log"
    dist_addr, ports = f"127.0.0.1:{free_port()}", [free_port(), free_port()]
    workers = [f"127.0.0.1:{port}" for port in ports]

    def rank(r: int):
        return start_worker(tiny_model_dir, ports[r], "--rank", str(r), "--tensor-parallel-size", "2",
                            "--dist-init-addr", dist_addr, *WORKER_FLAGS, log=log)

    procs = [rank(0)]
    waiting = f"rank 0 waiting for 2 ranks at {dist_addr}"
    deadline = time.monotonic() + 60  # a loaded CI machine takes seconds to import torch
    while waiting not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    address = f"127.0.0.1:{free_port()}"
    impatient = start_scheduler(workers, int(address.split(":")[1]), "--worker-connect-timeout", "4", log=log)
    procs.append(impatient)
    try:
        assert wait_answering(address) == NOT_SERVING
        with Client(address) as client, pytest.raises(grpc.RpcError) as info:
            client.generate([1, 2, 3], max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert impatient.wait(timeout=30) != 0
        text = log.read_text()
        assert waiting in text
        assert re.search(r"waiting for worker rank [01] at 127\.0\.0\.1:\d+", text)
        assert re.search(r"worker rank [01] at 127\.0\.0\.1:\d+ did not answer within 4s", text)

        address = f"127.0.0.1:{free_port()}"
        procs += [start_scheduler(workers, int(address.split(":")[1]), log=log), rank(1)]
        wait_serving(address, [procs[0], *procs[2:]], log)
        with Client(address) as client:
            assert len(client.generate([1, 2, 3], max_tokens=3, ignore_eos=True).token_ids) == 3
    finally:
        stop(procs)


def test_rank_dying_mid_stream_fails_in_flight_requests(models, tmp_path):
    """Nothing restarts the group: the request held for it ends after --worker-restart-timeout."""
    log = tmp_path / "services.log"
    with running_service(models["kv-split"], log, tensor_parallel_size=2, worker_flags=WORKER_FLAGS,
                         scheduler_flags=("--worker-restart-timeout", "2")) as svc, \
            Client(svc["address"]) as client:
        rank0, rank1 = svc["workers"]
        stream = client.stream(token_prompt(8), max_tokens=1000, temperature=0, ignore_eos=True, timeout=60)
        next(stream)
        rank1.kill()
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
        assert time.monotonic() - killed < 30
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert re.search(rf"worker rank [01] at 127\.0\.0\.1:({port_of(rank0)}|{port_of(rank1)})",
                         info.value.details())
        # Its peer gone mid-collective, rank 0 cannot go on in a broken group: it exits.
        assert rank0.wait(timeout=15) != 0
        assert re.search(r"(step \d+ failed|rank 0 lost a peer of its tensor-parallel group).*; exiting",
                         log.read_text())
        assert health_status(svc["address"]) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            client.generate([1, 2, 3], max_tokens=2)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_rank_dying_while_idle_takes_its_group_down_until_restarted(models, tmp_path):
    """No step runs when rank 1 dies, yet rank 0 leaves the broken group at once; both restarted,
    they form a new group and the scheduler serves again."""
    log = tmp_path / "services.log"
    prompt = token_prompt(12)
    with running_service(models["kv-split"], log, tensor_parallel_size=2, worker_flags=WORKER_FLAGS) as svc, \
            Client(svc["address"]) as client:
        before = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).token_ids
        rank0, rank1 = svc["workers"]
        rank1.kill()
        assert rank0.wait(timeout=15) != 0
        assert "rank 0 lost a peer of its tensor-parallel group" in log.read_text()
        deadline = time.monotonic() + 15
        while health_status(svc["address"]) != NOT_SERVING and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health_status(svc["address"]) == NOT_SERVING

        restarted = [start_worker(Path(models["kv-split"]), int(port_of(p)), *p.args[p.args.index("--rank"):],
                                  log=log) for p in (rank0, rank1)]
        svc["procs"].extend(restarted)
        wait_serving(svc["address"], [svc["scheduler"], *restarted], log)
        assert client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).token_ids == before
