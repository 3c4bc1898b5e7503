"""The sampler: greedy at temperature 0, draws that follow softmax(logits / T), and seeded requests
that give the same tokens whatever else shares the batch."""
import pytest
import torch

from model.sampler import Sampler, SamplingRow
from tests.worker.worker_steps import StepWriter, cpu_runner, generate

CPU = torch.device("cpu")


def sample(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return sampler(logits, sampler.batch(rows))


def test_temperature_zero_is_argmax_even_beside_sampled_rows():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(0.0, None, 0), SamplingRow(1.5, None, 0), SamplingRow(0.0, 3, 0)] * 2
    tokens = sample(Sampler(CPU, seed=0), logits, rows).tolist()
    argmax = logits.argmax(dim=-1).tolist()
    assert [tokens[i] for i in (0, 2, 3, 5)] == [argmax[i] for i in (0, 2, 3, 5)]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    draws = 20_000
    tokens = sample(Sampler(CPU, seed=1), logits.expand(draws, -1), [SamplingRow(temperature, None, 0)] * draws)
    frequencies = torch.bincount(tokens, minlength=5).float() / draws
    expected = torch.softmax(logits / temperature, dim=-1)
    # Binomial standard error is at most 0.0036 here; 4.5 sigma.
    assert (frequencies - expected).abs().max().item() < 0.016


def test_seeded_row_depends_only_on_seed_and_position():
    logits = torch.zeros(3, 50_000)  # uniform: every token equally likely, the draw is all noise
    sampler = Sampler(CPU, seed=0)

    def draw(sampler: Sampler, rows: list[SamplingRow]) -> list[int]:
        return sample(sampler, logits[:len(rows)], rows).tolist()

    alone = draw(sampler, [SamplingRow(1.0, 42, 5)])
    crowded = draw(sampler, [SamplingRow(1.0, None, 0), SamplingRow(0.7, 9, 5), SamplingRow(1.0, 42, 5)])
    assert crowded[2] == alone[0]
    assert draw(Sampler(CPU, seed=123), [SamplingRow(1.0, 42, 5)]) == alone  # worker seed irrelevant
    assert draw(sampler, [SamplingRow(1.0, 42, 6)]) != alone      # next position, new draw
    assert draw(sampler, [SamplingRow(1.0, 43, 5)]) != alone      # other seed, other draw


def test_seeded_generation_is_reproducible_in_any_batch_company(tiny_model_dir):
    """Through the runner: a seeded request's 16 tokens are the same alone or beside other requests
    (seeded and unseeded, other prompts); another seed gives other tokens."""
    prompt = [785, 3974, 13876, 38835, 34208]
    runner, writer = cpu_runner(tiny_model_dir), StepWriter(4)
    seeded = {"temperature": 1.0, "seed": 7}
    alone = generate(runner, writer, {1: prompt}, 16, {1: seeded})[1]
    company = generate(runner, writer, {5: [11, 22, 33], 1: prompt, 9: prompt},
                       16, {5: {"temperature": 0.8}, 1: seeded, 9: {"temperature": 1.0, "seed": 8}})
    assert company[1] == alone
    assert company[9] != alone
    assert len(set(alone)) > 8
