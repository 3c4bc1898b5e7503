"""The logits processors against transformers' own (TopK/TopP/MinP warpers, RepetitionPenalty,
MinNewTokensLength, SequenceBias) on fixed logits: the same tokens removed, the same values kept;
presence and frequency penalties against a plain per-token loop; and draws through the sampler
that follow the processed distribution."""
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from nanoserve_model.logits_processors import LogitsProcessors, ProcessorParams
from nanoserve_model.sampler import Sampler, SamplingRow

CPU = torch.device("cpu")
VOCAB = 1000
EOS = 7


def fixed_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def hf_row(logits: torch.Tensor, params: ProcessorParams, history: list[int] = (), num_prompt: int = 0) -> torch.Tensor:
    """One row through transformers' processors in vLLM's order (temperature before the warpers;
    the warpers' output back at temperature 1, as our processors leave the temperature to the sampler)."""
    ids = torch.tensor([list(history) or [0]])
    scores = logits[None].clone()
    if params.min_tokens:
        scores = MinNewTokensLengthLogitsProcessor(num_prompt, params.min_tokens,
                                                   list(params.banned_until_min_tokens))(ids, scores)
    if params.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias])(ids, scores)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    temperature = params.temperature or 1.0
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if params.min_p:
        scores = MinPLogitsWarper(params.min_p)(ids, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    return scores[0] * temperature


def ours(params: list[ProcessorParams], logits: torch.Tensor, histories=None, num_generated=None) -> torch.Tensor:
    processors = LogitsProcessors(capacity=len(params) + 3, vocab_size=VOCAB, device=CPU)
    slots = np.arange(len(params))[::-1].copy() + 2  # slots in another order than the rows
    for slot, p, i in zip(slots, params, range(len(params))):
        processors.reset(int(slot), p, (histories or {}).get(i, []), (num_generated or {}).get(i, 0))
    flags = processors.batch_flags(slots)
    return processors(logits, slots, torch.from_numpy(slots), flags)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    removed = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), removed), f"masks differ at {torch.nonzero(torch.isneginf(got) != removed)}"
    torch.testing.assert_close(got[~removed], want[~removed], rtol=1e-5, atol=1e-5)


WARPERS = [
    ProcessorParams(top_k=1), ProcessorParams(top_k=40), ProcessorParams(top_p=0.9), ProcessorParams(top_p=0.3),
    ProcessorParams(temperature=0.7, top_p=0.8), ProcessorParams(temperature=1.5, min_p=0.05),
    ProcessorParams(min_p=0.2), ProcessorParams(top_k=50, top_p=0.9),
    ProcessorParams(temperature=0.6, top_k=20, top_p=0.5),
    ProcessorParams(temperature=2.0, top_k=300, top_p=0.95, min_p=0.01), ProcessorParams(),
]


def short(params: ProcessorParams) -> str:
    """The fields that differ from the defaults, as a test id."""
    changed = [f"{k}={v}" for k, v in params._asdict().items() if v != ProcessorParams._field_defaults[k]]
    return ",".join(changed) or "none"


@pytest.mark.parametrize("params", WARPERS, ids=short)
def test_each_warper_removes_what_transformers_removes(params):
    logits = fixed_logits(1, seed=hash(params) % 1000)
    assert_same(ours([params], logits)[0], hf_row(logits[0], params))


def test_a_mixed_batch_gives_each_row_its_own_masks():
    """Rows with and without top-p, with and without top-k, in one batch: each as if alone."""
    logits = fixed_logits(len(WARPERS), seed=1)
    got = ours(WARPERS, logits)
    for row, params in enumerate(WARPERS):
        assert_same(got[row], hf_row(logits[row], params))


def test_top_p_within_top_k_matches_the_full_sort():
    """Every row has a top-k: top-p sorts only each row's top-k logits, with the same result."""
    rows = [ProcessorParams(top_k=k, top_p=p, temperature=t) for k, p, t in
            [(50, 0.9, 0.6), (5, 0.5, 1.0), (200, 0.99, 1.3), (1, 0.1, 0.8)]]
    logits = fixed_logits(len(rows), seed=2)
    got = ours(rows, logits)
    for row, params in enumerate(rows):
        assert_same(got[row], hf_row(logits[row], params))


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    history = [3, 3, 10, 500, 999, 10, 42]  # prompt (4) then output (3)
    logits = fixed_logits(2, seed=3)
    logits[:, history] = torch.tensor([2.0, -2.0, 0.5, -0.5, 3.0, 1.0, -1.0])  # both signs penalized
    params = [ProcessorParams(repetition_penalty=1.7), ProcessorParams(repetition_penalty=0.6)]
    got = ours(params, logits, {0: history, 1: history}, {0: 3, 1: 3})
    for row in range(2):
        assert_same(got[row], hf_row(logits[row], params[row], history))


def test_presence_and_frequency_penalties_match_a_plain_loop():
    history = [5, 6, 6, 9, 9, 9, 6]  # prompt [5, 6] is exempt from both; output counts 6: 2, 9: 3
    params = ProcessorParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.2)
    logits = fixed_logits(1, seed=4)
    want = logits[0].clone()
    for token in set(history):  # repetition: prompt and output alike
        want[token] = want[token] / 1.2 if want[token] > 0 else want[token] * 1.2
    for token in set(history[2:]):
        want[token] -= 0.5 + 0.25 * history[2:].count(token)
    assert_same(ours([params], logits, {0: history}, {0: 5})[0], want)


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    params = [ProcessorParams(min_tokens=3, banned_until_min_tokens=(EOS, 11)),
              ProcessorParams(min_tokens=3, banned_until_min_tokens=(EOS,)),
              ProcessorParams(min_tokens=0, banned_until_min_tokens=(EOS, 11))]
    logits = fixed_logits(3, seed=5)
    got = ours(params, logits, num_generated={0: 2, 1: 3})
    assert torch.isneginf(got[0, [EOS, 11]]).all()
    assert_same(got[0], hf_row(logits[0], params[0], [1, 2, 3, 4], num_prompt=2))  # 2 generated of 3
    assert_same(got[1], logits[1])  # 3 generated: free
    assert_same(got[2], logits[2])


def test_logit_bias_matches_sequence_bias():
    params = ProcessorParams(logit_bias=((1, 100.0), (17, -100.0), (400, 2.5)))
    logits = fixed_logits(2, seed=6)
    got = ours([params, ProcessorParams(top_k=3)], logits)
    assert_same(got[0], hf_row(logits[0], params))
    assert got[0].argmax() == 1


def test_penalty_counts_follow_the_sampled_tokens():
    """observe() counts each step's draws: the next step's penalty sees them."""
    processors = LogitsProcessors(capacity=4, vocab_size=VOCAB, device=CPU)
    processors.reset(1, ProcessorParams(frequency_penalty=1.0), [5, 5], num_generated=0)
    processors.reset(3, ProcessorParams(), [], num_generated=0)
    slots = np.array([1, 3])
    logits = torch.zeros(2, VOCAB)
    for token in (8, 8, 9):
        flags = processors.batch_flags(slots)
        out = processors(logits, slots, torch.from_numpy(slots), flags)
        processors.observe(torch.tensor([token, token]), slots, torch.from_numpy(slots), flags)
    assert (out[0, 8].item(), out[0, 9].item(), out[0, 5].item()) == (-2.0, 0.0, 0.0)
    assert torch.equal(out[1], logits[1])


def test_a_batch_asking_for_nothing_is_untouched():
    processors = LogitsProcessors(capacity=4, vocab_size=VOCAB, device=CPU)
    processors.reset(0, ProcessorParams(top_k=5), [], 0)
    processors.reset(1, ProcessorParams(temperature=0.3), [], 0)
    assert processors.batch_flags(np.array([1])) == 0
    processors.reset(0, ProcessorParams(), [], 0)  # the slot's next sequence asks for nothing
    assert processors.num_flagged == 0 and processors.batch_flags(np.array([0, 1])) == 0


@pytest.mark.parametrize("params", [ProcessorParams(top_k=3, temperature=1.0),
                                    ProcessorParams(top_p=0.8, temperature=0.8),
                                    ProcessorParams(min_p=0.3, temperature=1.2, top_p=0.95)],
                         ids=["top_k", "top_p", "min_p+top_p"])
def test_draws_follow_the_processed_distribution(params):
    """Seeded draws of the sampler over the processed logits: only kept tokens, in the
    proportions of transformers' processed softmax."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, 0.0, -0.5, -1.0] + [-3.0] * (VOCAB - 8))
    draws = 20_000
    processed = ours([params] * 1, logits[None])[0]
    sampler = Sampler(CPU, seed=3)
    tokens = sampler(processed.expand(draws, -1), sampler.batch([SamplingRow(params.temperature, None, 0)] * draws))
    frequencies = torch.bincount(tokens, minlength=VOCAB).float() / draws
    expected = torch.softmax(hf_row(logits, params) / params.temperature, dim=-1)
    assert (frequencies[expected == 0] == 0).all()
    assert (frequencies - expected).abs().max().item() < 0.016  # 4.5 binomial standard errors


def test_removing_passes_keep_the_logits_dtype_and_leave_them_untouched():
    """min_p, top_k and top_p only remove tokens: on bf16 logits they give bf16 logits with the
    masks and values that float32 processing of the same values gives, and never write into the
    caller's logits (a mixed batch processes a subset of its rows)."""
    rows = [ProcessorParams(top_k=50, top_p=0.9, temperature=0.6), ProcessorParams(top_k=5),
            ProcessorParams(top_p=0.5), ProcessorParams(min_p=0.1, top_p=0.95), ProcessorParams()]
    logits = fixed_logits(len(rows), seed=4).to(torch.bfloat16)
    before = logits.clone()
    got = ours(rows, logits)
    assert got.dtype == torch.bfloat16 and torch.equal(logits, before)
    want = ours(rows, logits.float())
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    assert torch.equal(got.float()[~torch.isneginf(want)], want[~torch.isneginf(want)])
