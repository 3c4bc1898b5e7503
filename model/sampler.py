"""Next-token sampling: greedy at temperature 0, otherwise the exponential race (Gumbel-max):
argmax(logits / T - log E) with E ~ Exp(1) draws exactly from softmax(logits / T)."""
import hashlib
from typing import NamedTuple

import torch

from model.compiled import fused_on_cuda


class SamplingRow(NamedTuple):  # a tuple: built once per sampled sequence per step, so cheap
    temperature: float
    seed: int | None     # per-request seed; None draws from the worker's own stream
    num_generated: int   # tokens this request has produced so far


def seeded_noise_seed(seed: int, num_generated: int) -> int:
    """The generator seed for one token of a seeded request: a function of (seed, position in the
    output) only, so the token does not depend on the batch, nor on a recompute after preemption."""
    digest = hashlib.blake2b(f"{seed}:{num_generated}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@fused_on_cuda
def race_scores(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """logits / T - log(E) per row; rows with T = 0 keep their plain logits (greedy)."""
    sampled = temperatures > 0
    scale = torch.where(sampled, temperatures, 1.0)[:, None]
    return logits.float() / scale - noise.log() * sampled[:, None]


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)

    def _noise(self, rows: list[SamplingRow], vocab_size: int) -> torch.Tensor:
        """Exp(1) noise [len(rows), vocab]: the worker's own stream, then each seeded row redrawn
        from its own generator (greedy rows ignore theirs)."""
        noise = torch.empty(len(rows), vocab_size, device=self.device).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.temperature > 0 and row.seed is not None:
                own = torch.Generator(self.device).manual_seed(seeded_noise_seed(row.seed, row.num_generated))
                noise[i].exponential_(generator=own)
        return noise

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token id per row of logits [len(rows), vocab], on the device (int64, no host sync);
        temperature is applied in float32."""
        if all(row.temperature == 0 for row in rows):
            return logits.argmax(dim=-1)
        temperatures = torch.tensor([row.temperature for row in rows])
        if self.device.type == "cuda":  # pinned, so the copy does not wait for the work queued before it
            temperatures = temperatures.pin_memory()
        temperatures = temperatures.to(self.device, non_blocking=True)
        return race_scores(logits, temperatures, self._noise(rows, logits.shape[-1])).argmax(dim=-1)
