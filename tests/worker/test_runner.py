"""The model runner's contract with the scheduler (worker.proto): what it reports, how it keeps
sequence state across delta steps, and how it refuses bad steps without disturbing others."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.worker.worker_steps import StepWriter, cpu_runner, generate
from worker_svc.config import WorkerConfig
from nanoserve.v1 import worker_pb2
from worker_svc.runner import ModelRunner
from worker_svc.server import WorkerService

BLOCK_SIZE = 4
PROMPT = [9707, 11, 847, 829, 374, 220, 16, 17]


@pytest.fixture
def runner(tiny_model_dir):
    return cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=64)


def test_info_describes_the_rank_and_sizes_kv_from_the_cpu_budget(tiny_model_dir):
    runner = ModelRunner(WorkerConfig(model=str(tiny_model_dir), device="cpu", block_size=16,
                                      cpu_kv_cache_gb=0.01, max_model_len=1024))
    info = runner.info()
    # 3 layers x K and V x 16 tokens x 2 KV heads x 16 dims x 4 bytes (float32 from config.json)
    assert info.max_kv_blocks == int(0.01 * 2**30) // (3 * 2 * 16 * 2 * 16 * 4)
    assert (info.rank, info.world_size, info.block_size) == (0, 1, 16)
    assert (info.dtype, info.device, info.attention_backend) == ("float32", "cpu", "torch")
    assert (info.vocab_size, info.max_model_len) == (151936, 1024)
    assert list(info.eos_token_ids) == [151645, 151643]  # config.json, then generation_config.json
    other = ModelRunner(WorkerConfig(model=str(tiny_model_dir), device="cpu", num_kv_blocks=7))
    assert other.info().max_kv_blocks == 7
    assert other.info().model_fingerprint == info.model_fingerprint
    bf16 = ModelRunner(WorkerConfig(model=str(tiny_model_dir), device="cpu", dtype="bfloat16"))
    assert bf16.info().model_fingerprint != info.model_fingerprint


def test_a_restarted_rank_takes_the_offered_kv_pool_only_for_its_own_configuration(tiny_model_dir):
    """The handshake's offer (DescribeRequest) is taken for an equal kv_sizing, without sizing the
    room; for another configuration's (here another memory share) the rank sizes its own."""
    def restarted(budget: float) -> WorkerService:
        return WorkerService(ModelRunner(WorkerConfig(model=str(tiny_model_dir), device="cpu", block_size=16,
                                                      cpu_kv_cache_gb=budget)))

    first = restarted(0.01).Describe(worker_pb2.DescribeRequest(), None)
    offer = worker_pb2.DescribeRequest(num_kv_blocks=100, kv_sizing=first.kv_sizing)
    assert restarted(0.01).Describe(offer, None).max_kv_blocks == 100
    other = restarted(0.02).Describe(offer, None)
    assert other.kv_sizing != first.kv_sizing
    assert other.max_kv_blocks == int(0.02 * 2**30) // (3 * 2 * 16 * 2 * 16 * 4)  # as the test above sizes it


def test_allocating_more_blocks_than_the_rank_holds_is_refused(runner):
    with pytest.raises(ValueError, match="65 KV blocks"):
        runner.allocate_kv_cache(65)


def test_step_returns_tokens_only_for_sampled_entries(runner):
    writer = StepWriter(BLOCK_SIZE)
    assert runner.step(writer.request(writer.entry(1, PROMPT[:5], reset=True, sample=False))) == []
    tokens = runner.step(writer.request(writer.entry(1, PROMPT[5:], 5), writer.entry(2, PROMPT, reset=True)))
    assert len(tokens) == 2 and tokens[0] == tokens[1]  # same prompt, whole or in two chunks


def test_forget_then_reuse_of_a_seq_id_needs_reset(runner):
    writer = StepWriter(BLOCK_SIZE)
    first = runner.step(writer.request(writer.entry(1, PROMPT, reset=True)))
    with pytest.raises(ValueError, match="sequence 1 is unknown"):
        runner.step(writer.request(writer.entry(1, first, len(PROMPT)), forget=(1,)))
    runner.step(writer.request(forget=(1,)))
    with pytest.raises(ValueError, match="sequence 1 is unknown"):
        runner.step(writer.request(writer.entry(1, first, len(PROMPT))))
    assert runner.step(writer.request(writer.entry(1, PROMPT, reset=True))) == first


@pytest.mark.parametrize("problem, message", [
    ("block", "block id 64 is out of range"),
    ("token", "token id 151936 is outside the vocabulary"),
    ("unknown", "sequence 7 is unknown"),
    ("too few blocks", "10 tokens need 3 blocks, its block table has 2"),
    ("duplicate", "appears twice"),
    ("nothing to feed in", "no token sampled by this worker at position 6"),
    ("ragged columns", r"columns disagree on the number of entries \(seq_ids 2, num_computed 3"),
    ("token bytes", "token_ids holds 9 bytes, not the 4 bytes of each of the 2 tokens"),
    ("extras past the entries", "the EntryExtras of entry 2 is out of order or out of range .* has 2 entries"),
    ("extras twice", "the EntryExtras of entry 1 is out of order or out of range \\(it follows entry 1's"),
])
def test_a_bad_step_is_refused_whole_and_disturbs_nothing(runner, problem, message):
    """A step with a good entry, a bad one and a forget: ValueError naming the problem, and no
    sequence state changed, the forget included; the good entry then runs as if nothing happened."""
    writer = StepWriter(BLOCK_SIZE)
    out = runner.step(writer.request(*(writer.entry(i, PROMPT[:3 + i], reset=True) for i in (1, 2, 3))))
    def snapshot():
        return dict(runner.seqs.states), runner.seqs.block_tables.copy(), list(runner.seqs.free_slots)

    before = snapshot()
    good, bad = writer.entry(1, out[:1], 4), writer.entry(2, out[1:2], 5)
    if problem == "block":
        bad.new_block_ids.append(64)
    elif problem == "token":
        bad.token_ids[0] = 151936
    elif problem == "unknown":
        bad.seq_id = 7
    elif problem == "too few blocks":
        bad.token_ids.extend([5] * 4)
    elif problem == "nothing to feed in":
        bad.num_computed += 1
        del bad.token_ids[:]
    elif problem == "duplicate":
        bad.seq_id = 1
    request = writer.request(good, bad, forget=(3,))
    if problem == "ragged columns":
        request.num_computed.append(0)
    elif problem == "token bytes":
        request.token_ids += b"\0"
    elif problem == "extras past the entries":
        request.extras.add(entry=2)
    elif problem == "extras twice":
        request.extras.add(entry=1, new_block_ids=[5])
        request.extras.add(entry=1, new_block_ids=[6])
    with pytest.raises(ValueError, match=message):
        runner.step(request)
    after = snapshot()
    assert after[0] == before[0] and (after[1] == before[1]).all() and after[2] == before[2]
    assert runner.step(writer.request(good)) == cpu_runner_continuation(runner.config.model, out[0])


def cpu_runner_continuation(model_dir: str, first: int) -> list[int]:
    """Sequence 1's second token in a run that never saw a bad step."""
    runner, writer = cpu_runner(model_dir, BLOCK_SIZE, num_blocks=64), StepWriter(BLOCK_SIZE)
    runner.step(writer.request(writer.entry(1, PROMPT[:4], reset=True)))
    return runner.step(writer.request(writer.entry(1, [first], 4)))


def test_steps_beyond_the_worker_limits_are_refused(tiny_model_dir):
    runner = cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=10)
    writer = StepWriter(BLOCK_SIZE)
    with pytest.raises(ValueError, match="3 sequences"):
        runner.step(writer.request(*(writer.entry(i, [1], reset=True) for i in range(3))))
    with pytest.raises(ValueError, match="11 tokens"):
        runner.step(writer.request(writer.entry(1, list(range(11)), reset=True)))
    with pytest.raises(ValueError, match="model length limit"):
        cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=64, max_model_len=8).step(
            writer.request(writer.entry(1, list(range(9)), reset=True)))


def test_step_before_the_kv_cache_is_allocated_is_refused(tiny_model_dir):
    runner = ModelRunner(WorkerConfig(model=str(tiny_model_dir), device="cpu", num_kv_blocks=8))
    writer = StepWriter(BLOCK_SIZE)
    with pytest.raises(ValueError, match="KV cache"):
        runner.step(writer.request(writer.entry(1, PROMPT, reset=True)))


def test_recompute_after_preemption_continues_the_same_greedy_tokens(runner):
    """A preempted sequence comes back with reset, its prompt and generated tokens to recompute."""
    writer = StepWriter(BLOCK_SIZE)
    whole = generate(runner, writer, {1: PROMPT}, 12)[1]
    generate(runner, writer, {1: PROMPT}, 5)
    resumed = generate(runner, writer, {1: PROMPT + whole[:5]}, 7)[1]
    assert whole[:5] + resumed == whole


def test_bfloat16_runner_stays_close_to_float32(tiny_model_dir):
    writer = StepWriter(BLOCK_SIZE)
    request = writer.request(writer.entry(1, PROMPT, reset=True))
    fp32 = cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=8).step_logits(request)
    bf16 = cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=8, dtype="bfloat16")
    assert bf16.model.model.embed_tokens.weight.dtype == torch.bfloat16
    logits = bf16.step_logits(request)
    assert logits.dtype == torch.bfloat16
    assert ((logits.float() - fp32).abs().max() / fp32.abs().max()).item() < 0.05


def test_pipelined_decode_feeds_in_its_own_tokens(runner):
    """The scheduler's pipelined protocol: each decode launched before the step before it has
    replied, sending no token; the runner feeds in the token it sampled itself. Greedy and seeded
    sampled sequences give exactly the tokens of the plain protocol."""
    prompts = {1: PROMPT, 2: PROMPT[:5], 3: [11, 22, 33]}
    sampling = {2: {"temperature": 0.9, "seed": 4}, 3: {"temperature": 1.0, "seed": 5}}
    plain = generate(runner, StepWriter(BLOCK_SIZE), prompts, 10, sampling)
    pipelined = generate(runner, StepWriter(BLOCK_SIZE), prompts, 10, sampling, pipelined=True)
    assert pipelined == plain
    assert len(set(plain[3])) > 3


def test_a_worker_loads_no_compiler(tiny_model_dir):
    """Importing the model and starting a runner loads neither dynamo nor inductor (their import alone
    costs seconds of CPU, and compiling took seconds of every GPU worker's start): the fused ops are
    Triton kernels, whose compiled forms load from Triton's cache."""
    code = f"""
import sys
import nanoserve_model.qwen3, nanoserve_model.sampler, worker_svc.runner
from worker_svc.config import WorkerConfig
worker_svc.runner.ModelRunner(WorkerConfig(model={str(tiny_model_dir)!r}, device="cpu", num_kv_blocks=8))
assert not {{"torch._dynamo", "torch._inductor"}} & set(sys.modules), sorted(m for m in sys.modules if "_dynamo" in m)
"""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "proto")])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
