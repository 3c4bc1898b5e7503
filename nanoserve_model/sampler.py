"""Next-token sampling: greedy at temperature 0, otherwise the exponential race, which draws exactly
from softmax(logits / T) (nanoserve_kernels/race_sampling.py): on CUDA two Triton launches for the whole
batch, elsewhere plain torch. Logit processors (top-k/p, penalties) compose by changing the logits
before the race.

Every sampled row brings a temperature, a 64-bit key and a counter, which name its noise. A request
with a seed draws under key = its seed and counter = the tokens it has produced so far, so each of
its tokens depends on (seed, position in the output) alone: not on the batch, nor on a recompute
after preemption. Other rows draw from the worker's own stream: key = the worker's seed, counter =
the worker's running draw count with the top bit set, so the two kinds never share noise.
"""
from typing import NamedTuple

import numpy as np
import torch

from nanoserve_kernels.race_sampling import race_sample
from nanoserve_kernels.token_bitmask import TokenMasks

# The worker's own draws count in the upper half of the counter space, which seeded rows (whose
# counter is a token count) never reach.
UNSEEDED_COUNTER = np.int64(-2**63)


class SamplingRow(NamedTuple):
    """One row's parameters as a request gives them (tests, warm-up); steps stage columns instead."""
    temperature: float
    seed: int | None     # per-request seed; None draws from the worker's own stream
    num_generated: int   # tokens this request has produced so far


class SamplingBatch(NamedTuple):
    """Per sampled row, on the logits' device; and whether every row is greedy, known on the host."""
    temperatures: torch.Tensor  # [S] float (0: greedy)
    keys: torch.Tensor          # [S] int64
    counters: torch.Tensor      # [S] int64
    all_greedy: bool


def seed_key(seed: int) -> int:
    """A request's uint64 seed as the int64 with the same bits."""
    return seed - 2**64 if seed >= 2**63 else seed


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.key = seed_key(seed)
        self.draws = 0  # draws taken from the worker's own stream
        self._race = race_sample
        if device.type == "cuda":  # Triton is a GPU requirement only, so imported here
            from nanoserve_kernels.triton_sampling import race_sample as race_sample_on_gpu
            self._race = race_sample_on_gpu

    def stage(self, temperatures: np.ndarray, seeds: np.ndarray, seeded: np.ndarray, num_generated: np.ndarray,
              out: "SamplingColumns") -> None:
        """Writes the rows' keys and counters (and temperatures) into host columns: `seeds` holds
        seed_key values where `seeded` is set."""
        count = len(seeded)
        out.temperatures[:count] = temperatures
        out.keys[:count] = np.where(seeded, seeds, self.key)
        out.counters[:count] = np.where(seeded, num_generated, (self.draws + np.arange(count)) | UNSEEDED_COUNTER)
        self.draws += count

    def batch(self, rows: list[SamplingRow]) -> SamplingBatch:
        """The batch of the given rows, in fresh device tensors."""
        columns = SamplingColumns(np.empty(len(rows)), np.empty(len(rows), np.int64), np.empty(len(rows), np.int64))
        seeded = np.array([row.seed is not None for row in rows], bool)
        self.stage(np.array([row.temperature for row in rows], np.float64),
                   np.array([seed_key(row.seed or 0) for row in rows], np.int64), seeded,
                   np.array([row.num_generated for row in rows], np.int64), columns)
        return SamplingBatch(*(torch.from_numpy(column).to(self.device) for column in columns),
                             all_greedy=not columns.temperatures.any())

    def warm_up(self, logits: torch.Tensor, masks: TokenMasks | None = None) -> None:
        """Samples the first n rows of logits for every n, largest first: the race's launch shape
        follows the row count, and a shape first met while serving compiles there (~1 s each on a
        cold Triton cache: the first throughput run on a fresh machine was 27% slower). With `masks`
        (a row for each of the logits'), the masked race's shapes."""
        batch = self.batch([SamplingRow(1.0, None, 0)] * len(logits))
        for rows in range(len(logits), 0, -1):
            self(logits[:rows], SamplingBatch(batch.temperatures[:rows], batch.keys[:rows], batch.counters[:rows],
                                              all_greedy=False),
                 masks and TokenMasks(masks.table, masks.rows[:rows]))

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, masks: TokenMasks | None = None) -> torch.Tensor:
        """One token id per row of logits [S, vocab], on the device (int64, no host sync);
        temperature is applied in float32; `masks`: the rows' grammar masks, applied inside the race.
        An all-greedy batch with no masks takes one argmax (the race's own greedy rule) and skips the
        race's launches."""
        if batch.all_greedy and masks is None:
            return logits.argmax(dim=-1)
        return self._race(logits, batch.temperatures, batch.keys, batch.counters, masks)


class SamplingColumns(NamedTuple):
    """Host columns that Sampler.stage fills (numpy arrays, at least as long as the batch)."""
    temperatures: np.ndarray  # float64
    keys: np.ndarray          # int64
    counters: np.ndarray      # int64
