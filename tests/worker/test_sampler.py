"""The sampler: greedy at temperature 0, draws that follow softmax(logits / T), and seeded requests
that give the same tokens whatever else shares the batch."""
import math

import pytest
import torch

from nanoserve_kernels.race_sampling import exponential_noise, philox4x32
from nanoserve_model.sampler import Sampler, SamplingRow
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
    greedy = Sampler(CPU, seed=0).batch([SamplingRow(0.0, 3, 0)] * 6)  # no race: one argmax
    assert greedy.all_greedy and Sampler(CPU, seed=0)(logits, greedy).tolist() == argmax


def test_warm_up_races_every_row_count_so_serving_compiles_nothing():
    sampler, seen = Sampler(CPU, seed=0), []
    race = sampler._race
    sampler._race = lambda logits, *columns: seen.append(len(logits)) or race(logits, *columns)
    sampler.warm_up(torch.randn(5, 100))
    assert seen == [5, 4, 3, 2, 1]


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


@pytest.mark.parametrize("counter, key, expected", [
    # Random123's known-answer vectors for Philox4x32-10 (kat_vectors)
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_noise_is_standard_philox(counter, key, expected):
    words = philox4x32(tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key))
    assert tuple(int(w) for w in words) == expected


def test_noise_is_exponential_and_never_zero():
    """Exp(1) draws from the uniform words: the mean, the tail, and the smallest and largest words
    (which must give a small positive E, not 0, and a finite one)."""
    words = torch.randint(0, 2**32, (400_000,), generator=torch.Generator().manual_seed(3))
    noise = exponential_noise(words)
    assert abs(noise.mean().item() - 1) < 0.01 and abs((noise > 2).float().mean().item() - math.exp(-2)) < 0.003
    extremes = exponential_noise(torch.tensor([0, 1, 2**24, 2**32 - 1]))
    assert (extremes > 0).all() and torch.isfinite(extremes).all()
    v = torch.tensor([0.5, 1.5, 2**24 + 0.5], dtype=torch.float64) * 2.0**-32
    torch.testing.assert_close(extremes[:3].double(), -torch.log1p(-v), rtol=1e-6, atol=0)
