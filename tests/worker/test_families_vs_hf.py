"""Llama (3.x rope scaling, biases), Qwen2 (q/k/v bias) and Mistral on the paged KV cache (float32, CPU)
against transformers' own implementation of each on the same tiny checkpoint: logits of batched prefill,
of decode steps across blocks and of chunked prefill beside decodes, and greedy generations."""
import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanoserve_model.registry import read_model_config
from nanoserve_model.rotary import inverse_frequencies
from tests.worker.families import FAMILIES, family_model_dir, hf_model
from tests.worker.test_model_vs_hf import assert_close, hf_logits, random_prompt
from tests.worker.worker_steps import StepWriter, cpu_runner, generate

BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> tuple:
    path = family_model_dir(request.param)
    return path, hf_model(path)


def test_the_oracle_is_the_family_itself(family):
    path, hf = family
    assert type(hf).__name__ == read_model_config(path).architecture


def test_batched_prefill_matches_transformers(family):
    path, hf = family
    prompts = [random_prompt(n, seed) for seed, n in enumerate([5, 12, 1, 17, 70])]
    writer = StepWriter(BLOCK_SIZE)
    logits = cpu_runner(path, BLOCK_SIZE).step_logits(
        writer.request(*(writer.entry(i, p, reset=True) for i, p in enumerate(prompts))))
    for row, prompt in zip(logits, prompts):
        assert_close(row, hf_logits(hf, prompt)[-1])


def assert_decodes_beside_chunked_prefill(path, full: list[int], prompt_len: int, long_prompt: list[int],
                                          reference: torch.Tensor, long_reference: torch.Tensor) -> None:
    """Sequence 1 (its prompt: full's first prompt_len tokens) decodes 20 steps (a new block every
    fourth) fed full's next tokens, while the 23-token long_prompt is prefilled in chunks of 7, 7 and 9
    beside its first three decodes; logits compared with `reference` (transformers' over full) at every
    step and with `long_reference` (over long_prompt) after the last chunk."""
    runner, writer = cpu_runner(path, BLOCK_SIZE), StepWriter(BLOCK_SIZE)
    logits = runner.step_logits(writer.request(writer.entry(1, full[:prompt_len], reset=True)))
    chunks = [(0, 7), (7, 14), (14, 23)]
    for step in range(20):
        assert_close(logits[0], reference[prompt_len - 1 + step])
        entries = [writer.entry(1, [full[prompt_len + step]], prompt_len + step)]
        if step < len(chunks):
            start, end = chunks[step]
            entries.append(writer.entry(2, long_prompt[start:end], start, reset=start == 0,
                                        sample=end == len(long_prompt)))
        logits = runner.step_logits(writer.request(*entries))
        if step == len(chunks) - 1:
            assert_close(logits[1], long_reference)


def test_decode_steps_and_chunked_prefill_match_transformers(family):
    path, hf = family
    short, long_prompt = random_prompt(6, 10), random_prompt(23, 11)
    full = hf.generate(torch.tensor([short]), max_new_tokens=21, min_new_tokens=21, do_sample=False)[0].tolist()
    assert_decodes_beside_chunked_prefill(path, full, len(short), long_prompt, hf_logits(hf, full),
                                          hf_logits(hf, long_prompt)[-1])


def test_greedy_generation_equals_transformers_generate(family):
    path, hf = family
    prompts = {i: random_prompt(n, 40 + i) for i, n in enumerate([4, 9, 15])}
    ours = generate(cpu_runner(path, BLOCK_SIZE), StepWriter(BLOCK_SIZE), prompts, 16)
    for seq_id, prompt in prompts.items():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                               do_sample=False)[0, len(prompt):].tolist()
        assert ours[seq_id] == expected
        assert len(set(expected)) > 8  # the tiny model wanders; a stuck model would prove little


def test_llama3_frequencies_are_transformers_own():
    """All three bands of the scaling are in use in the tiny Llama: kept, blended and divided."""
    path = family_model_dir("llama")
    config = read_model_config(path)
    ours = inverse_frequencies(config.head_dim, config.rope)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_model(path).config, "cpu")
    assert torch.allclose(ours, theirs.float(), rtol=1e-6, atol=0)
    plain = inverse_frequencies(config.head_dim, type(config.rope)(config.rope.theta))
    ratio = plain / ours
    assert ratio[0] == 1 and ratio[-1] == pytest.approx(config.rope.factor) and ((ratio > 1) & (ratio < 8)).any()
