"""Our Qwen3 on the paged KV cache (float32, CPU) against transformers' own Qwen3ForCausalLM on the
same checkpoint: logits of batched prefill, decode, prefix-cache hits and chunked prefill, and
greedy generations."""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.worker.worker_steps import StepWriter, cpu_runner, generate

BLOCK_SIZE = 4


def hf_model(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return hf_model(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_tied(tiny_tied_model_dir):
    return hf_model(tiny_tied_model_dir)


@pytest.fixture
def runner(tiny_model_dir):
    return cpu_runner(tiny_model_dir, BLOCK_SIZE)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(151_643) for _ in range(length)]  # the tokenizer's ordinary tokens


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of the sequence: [len, vocab]."""
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0]


def assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    error = ((ours - reference).abs().max() / reference.abs().max()).item()
    assert error < 1e-4, f"relative error {error:.2e}"


def test_batched_prefill_matches_transformers(runner, hf):
    prompts = [random_prompt(n, seed) for seed, n in enumerate([5, 12, 1, 17, 8])]
    writer = StepWriter(BLOCK_SIZE)
    logits = runner.step_logits(writer.request(*(writer.entry(i, p, reset=True) for i, p in enumerate(prompts))))
    assert logits.shape == (len(prompts), 151936)
    for row, prompt in zip(logits, prompts):
        assert_close(row, hf_logits(hf, prompt)[-1])


def test_decode_steps_cross_blocks_and_match_transformers(runner, hf):
    """Two sequences of different lengths decode together for 32 steps (block size 4: a new block
    every fourth step), fed transformers' greedy tokens; logits compared at every step."""
    prompts = [random_prompt(6, 10), random_prompt(3, 11)]
    full = [hf.generate(torch.tensor([p]), max_new_tokens=33, min_new_tokens=33, do_sample=False)[0].tolist()
            for p in prompts]
    reference = [hf_logits(hf, seq) for seq in full]
    writer = StepWriter(BLOCK_SIZE)
    logits = runner.step_logits(writer.request(*(writer.entry(i, p, reset=True) for i, p in enumerate(prompts))))
    for step in range(33):
        for i, prompt in enumerate(prompts):
            assert_close(logits[i], reference[i][len(prompt) - 1 + step])
        entries = [writer.entry(i, [full[i][len(p) + step]], len(p) + step) for i, p in enumerate(prompts)]
        logits = runner.step_logits(writer.request(*entries))


def test_prefix_cached_prompt_computes_only_its_suffix(runner, hf):
    """The second prompt shares 3 full blocks with the first; it reuses them and computes 5 tokens."""
    first = random_prompt(14, 20)
    second = first[:12] + random_prompt(5, 21)
    writer = StepWriter(BLOCK_SIZE)
    runner.step(writer.request(writer.entry(1, first, reset=True)))
    cached = tuple(writer.tables[1][:3])
    logits = runner.step_logits(writer.request(writer.entry(2, second[12:], 12, reset=True, shared_blocks=cached)))
    assert_close(logits[0], hf_logits(hf, second)[-1])


def test_chunked_prefill_beside_decodes_matches_transformers(runner, hf):
    """A 23-token prompt in chunks of 7, 7 and 9 (a token sampled only after the last), each chunk in a
    step with another sequence's decode entry: mixed steps take the prefill path for everything."""
    long_prompt, short = random_prompt(23, 30), random_prompt(5, 31)
    decoded = hf.generate(torch.tensor([short]), max_new_tokens=3, min_new_tokens=3, do_sample=False)[0].tolist()
    short_reference = hf_logits(hf, decoded)
    writer = StepWriter(BLOCK_SIZE)
    runner.step(writer.request(writer.entry(2, short, reset=True)))
    chunks = [(0, 7), (7, 14), (14, 23)]
    for step, (start, end) in enumerate(chunks):
        last = end == len(long_prompt)
        chunk = writer.entry(1, long_prompt[start:end], start, reset=start == 0, sample=last)
        decode = writer.entry(2, [decoded[5 + step]], 5 + step)
        logits = runner.step_logits(writer.request(chunk, decode))
        assert logits.shape[0] == (2 if last else 1)
        assert_close(logits[-1], short_reference[5 + step])
    assert_close(logits[0], hf_logits(hf, long_prompt)[-1])


def test_mixed_step_with_leading_decodes_matches_transformers(runner, hf):
    """As the scheduler sends a mixed step: decodes first (across a block boundary too), then a
    prompt's middle chunk that samples nothing, a last chunk and a new prompt that sample. The decodes
    attend through the decode kernel, the rest through the prefill kernel, in one forward pass."""
    shorts = {2: random_prompt(4, 32), 3: random_prompt(9, 33)}  # their first decode opens a block / not
    long_prompt, chunked, fresh = random_prompt(13, 34), random_prompt(10, 35), random_prompt(6, 36)
    writer = StepWriter(BLOCK_SIZE)
    first = runner.step(writer.request(*(writer.entry(i, p, reset=True) for i, p in shorts.items()),
                                       writer.entry(5, chunked[:3], reset=True, sample=False)))
    runner.step(writer.request(writer.entry(1, long_prompt[:5], reset=True, sample=False)))
    logits = runner.step_logits(writer.request(
        *(writer.entry(i, [token], len(shorts[i])) for i, token in zip(shorts, first)),
        writer.entry(1, long_prompt[5:9], 5, sample=False),
        writer.entry(5, chunked[3:], 3),
        writer.entry(4, fresh, reset=True)))
    assert logits.shape[0] == 4  # the decodes, then the chunk that ends its prompt, then the fresh prompt
    for row, (seq_id, token) in zip(logits, zip(shorts, first)):
        assert_close(row, hf_logits(hf, shorts[seq_id] + [token])[-1])
    assert_close(logits[2], hf_logits(hf, chunked)[-1])
    assert_close(logits[3], hf_logits(hf, fresh)[-1])
    # The middle chunk's K/V landed where the prompt's last chunk reads it.
    last = runner.step_logits(writer.request(writer.entry(1, long_prompt[9:], 9)))
    assert_close(last[0], hf_logits(hf, long_prompt)[-1])


@pytest.mark.parametrize("tied", [False, True])
def test_greedy_generation_equals_transformers_generate(tied, tiny_model_dir, tiny_tied_model_dir, hf, hf_tied):
    model_dir, reference = (tiny_tied_model_dir, hf_tied) if tied else (tiny_model_dir, hf)
    prompts = {i: random_prompt(n, 40 + i) for i, n in enumerate([4, 9, 15])}
    ours = generate(cpu_runner(model_dir, BLOCK_SIZE), StepWriter(BLOCK_SIZE), prompts, 32)
    for seq_id, prompt in prompts.items():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                                      do_sample=False)[0, len(prompt):].tolist()
        assert ours[seq_id] == expected
        assert len(set(expected)) > 8  # the tiny model wanders; a stuck model would prove little
