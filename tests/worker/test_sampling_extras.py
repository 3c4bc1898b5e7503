"""The runner's sampling extras, driven by hand: a penalized sequence recomputed after a preemption
(reset with its history) continues with the tokens it would have drawn undisturbed; sampling
params the processors could not index with are refused like any bad step."""
import pytest
import torch

from tests.worker.worker_steps import StepWriter, cpu_runner
from worker_svc.sampling_extras import SamplingExtras

PROMPT = [785, 3974, 13876, 38835, 34208, 11, 323]
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=64)


def penalized(entry, history: list[int] = ()):
    """The entry with a frequency penalty strong enough to change greedy tokens, and its history."""
    entry.sampling.frequency_penalty = entry.sampling.presence_penalty = 2.0
    entry.sampling.repetition_penalty = 0.3  # favours the prompt's tokens: only the penalties stop repeats
    entry.history_token_ids.extend(history)
    return entry


def greedy(runner, writer: StepWriter, seq_id: int, prompt: list[int], num_tokens: int, generated: int = 0,
           history: list[int] = ()) -> list[int]:
    out = runner.step(writer.request(penalized(writer.entry(seq_id, prompt, reset=True, num_generated=generated),
                                               history)))
    for index in range(num_tokens - 1):
        out += runner.step(writer.request(writer.entry(seq_id, out[-1:], len(prompt) + index,
                                                       num_generated=generated + index + 1)))
    runner.step(writer.request(forget=(seq_id,)))
    return out


def test_a_recomputed_sequence_keeps_its_penalty_counts(runner):
    writer = StepWriter(BLOCK_SIZE)
    undisturbed = greedy(runner, writer, 1, PROMPT, 8, history=PROMPT)
    first = greedy(runner, writer, 2, PROMPT, 4, history=PROMPT)
    assert first == undisturbed[:4]
    recomputed = PROMPT + first
    rest = greedy(runner, writer, 3, recomputed, 4, generated=4, history=recomputed)
    assert first + rest == undisturbed
    without_history = greedy(runner, writer, 4, recomputed, 4, generated=4, history=PROMPT + [0] * 4)
    assert without_history != rest  # the counts came from the history: forgetting them shows


@pytest.mark.parametrize("problem, message", [
    ("bias", "token id 151936 in its sampling params or history is outside the vocabulary"),
    ("history", "token id 200000 in its sampling params or history is outside the vocabulary"),
    ("short history", "its history has 2 tokens, fewer than the 3 it generated"),
    ("logprobs", "logprobs or prompt_logprobs exceed the vocabulary"),
    ("targets", "3 prompt logprob targets for 2 tokens"),
])
def test_params_the_processors_cannot_take_are_refused(runner, problem, message):
    writer = StepWriter(BLOCK_SIZE)
    entry = writer.entry(9, PROMPT[:2], reset=True, num_generated=3 if problem == "short history" else 0)
    if problem == "bias":
        entry.sampling.logit_bias[151936] = 1.0
    elif problem == "history":
        entry.history_token_ids.extend([1, 200000])
    elif problem == "short history":
        entry.history_token_ids.extend([1, 2])
    elif problem == "logprobs":
        entry.sampling.logprobs = 10**6
    else:
        entry.prompt_logprob_targets.extend([1, 2, 3])
    with pytest.raises(ValueError, match=message):
        runner.step(writer.request(entry))
    assert 9 not in runner.seqs.states


def test_the_heaviest_processing_runs_every_pass():
    """What the worker measures before sizing the KV cache: penalties, min_p, top-p over whole
    sorted rows and logprobs, on a full batch."""
    extras = SamplingExtras(capacity=4, vocab_size=1000, eos_token_ids=(7,), device=torch.device("cpu"), samples=True)
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    processed = extras.heaviest(logits)
    kept = ~torch.isneginf(processed)
    assert kept.any(dim=-1).all() and not kept.all(dim=-1).any()
    assert extras.processors.output_counts is not None  # the penalties' state is part of the peak
