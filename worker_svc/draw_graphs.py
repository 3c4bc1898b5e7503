"""The draw of a small decode step whose graph computed its logits (worker_svc/cuda_graphs.py), replayed from
CUDA graphs too: one a batch bucket and kind of draw (the argmax of an all-greedy batch, the race, the race under
every row's grammar mask), each over the static logits, the step buffers' sampling columns and sampled slots,
and the grammar's device mask table, writing one static token buffer.

Eagerly the race is two Triton launches, whose host cost (~0.14 ms a step on an H100 host) is most of a small
draw's; replayed it is one graph launch. A draw that its processors copy the logits for, or whose masks cover
some rows only (their rows are uploaded a step at a time), runs eagerly. Padding rows draw from stale columns
and masks, as the forward's padding computes stale rows: their tokens are dropped.
"""
from enum import Enum

import torch

from nanoserve_kernels.token_bitmask import TokenMasks
from nanoserve_model.sampler import Sampler, SamplingBatch


class DrawKind(Enum):
    ARGMAX = "argmax"  # every row greedy, no masks: the sampler's one argmax
    RACE = "race"
    MASKED = "masked"  # the race, every row reading its slot's mask (greedy rows as the race's own rule)


class DrawGraphs:
    def __init__(self, sampler: Sampler, logits: torch.Tensor, sampling: SamplingBatch, slots: torch.Tensor,
                 mask_table: torch.Tensor | None, buckets: list[int], pool, stream: torch.cuda.Stream):
        """`logits` [rows, vocab], `sampling` and `slots` (each row's slot) [rows]: the static buffers a step's
        draw reads, rows at least the largest of `buckets`; `mask_table`: the grammar's device table (None:
        no masked kind)."""
        self.logits, self.slots, self.mask_table = logits, slots, mask_table
        self.tokens = torch.zeros(len(slots), dtype=torch.int64, device=logits.device)
        self.graphs: dict[tuple[int, DrawKind], torch.cuda.CUDAGraph] = {}
        kinds = [kind for kind in DrawKind if kind is not DrawKind.MASKED or mask_table is not None]
        for bucket in sorted(buckets, reverse=True):
            for kind in kinds:
                batch = SamplingBatch(sampling.temperatures[:bucket], sampling.keys[:bucket],
                                      sampling.counters[:bucket], all_greedy=kind is DrawKind.ARGMAX)
                masks = TokenMasks(mask_table, slots[:bucket]) if kind is DrawKind.MASKED else None
                self._draw(sampler, bucket, batch, masks)  # compiles what a first call does, outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool, stream=stream):
                    self._draw(sampler, bucket, batch, masks)
                self.graphs[bucket, kind] = graph

    def _draw(self, sampler: Sampler, rows: int, batch: SamplingBatch, masks: TokenMasks | None) -> None:
        self.tokens[:rows] = sampler(self.logits[:rows], batch, masks)

    def replay(self, num_rows: int, bucket: int, batch: SamplingBatch, masks: TokenMasks | None) -> torch.Tensor | None:
        """The tokens [num_rows] of the draw `batch` and `masks` ask for from the first num_rows of the static
        logits, replayed in `bucket`'s graph; None if no graph holds that draw (the caller draws eagerly)."""
        kind = self._kind(batch, masks)
        if kind is None:
            return None
        self.graphs[bucket, kind].replay()
        return self.tokens[:num_rows]

    def _kind(self, batch: SamplingBatch, masks: TokenMasks | None) -> DrawKind | None:
        if masks is None:
            return DrawKind.ARGMAX if batch.all_greedy else DrawKind.RACE
        every_row = masks.rows.data_ptr() == self.slots.data_ptr()  # the step's own sampled slots, in place
        return DrawKind.MASKED if masks.table is self.mask_table and every_row else None
