"""The worker's CUDA graphs: decode steps replayed whole, one graph per batch-size bucket (here);
every other step piecewise, one set per token-count bucket (worker_svc.prefill_graphs).

A decode step launches a few hundred small kernels; replaying a captured graph removes their
launch cost. Every bucket is captured over the first rows of the worker's step buffers, the same
device buffers an eager step reads, so a step's inputs are in place for replay as soon as
build_step_inputs has queued their copies: rows past the live batch are padding the kernels skip
(slot -1, context length 0). Every bucket writes one static output buffer.

All graphs share one memory pool: a step replays one bucket's graphs, in capture order, and no
tensor in the pool outlives a replay (inputs and outputs live in static buffers outside it), so the
pool needs only what the most demanding bucket does. They are captured largest first, so the
smaller ones reuse its memory.

With one rank, decode buckets of up to LOGITS_GRAPH_MAX_ROWS rows also compute the LM head's logits inside
the graph, into one static buffer, and their draw replays too (worker_svc/draw_graphs.py): at those sizes the
host, not the device, sets a step's pace (a 0.6B batch-1 step: the launcher ~1.06 ms, the device ~0.85), and
the LM head's and the race's Triton launches were ~0.3 ms of the launcher's time (bench/RESULTS.md). Larger
batches, whose device step hides their launches, compute their logits eagerly: the copy into the static buffer
would cost them device time, and the buffer memory. With tensor parallelism the logits are a gather to rank 0,
left out of the graphs.
"""
import bisect
import logging
import time
from typing import Callable, NamedTuple

import torch

from nanoserve_kernels.backend import AttentionBackend
from nanoserve_kernels.token_bitmask import TokenMasks
from nanoserve_model.attention import Attention
from nanoserve_model.sampler import Sampler, SamplingBatch
from nanoserve_model.step_context import StepContext, step_context
from worker_svc.draw_graphs import DrawGraphs
from worker_svc.prefill_graphs import PrefillGraphs
from worker_svc.sequence_table import StepWork
from worker_svc.step_buffers import StepBuffers

log = logging.getLogger("nanoserve.worker")
LOGITS_GRAPH_MAX_ROWS = 64


class DecodeHead(NamedTuple):
    """What a decode graph needs to compute its logits and replay their draw (one rank only)."""
    compute_logits: Callable[[torch.Tensor], torch.Tensor]
    vocab_size: int
    sampler: Sampler
    mask_table: torch.Tensor | None  # the grammar masks' device table (the sampling rank's)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (which is always a bucket)."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + [b for b in range(16, max_num_seqs, 16)] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, run_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 backend: AttentionBackend, buffers: StepBuffers, hidden_size: int, dtype: torch.dtype,
                 buckets: list[int], pool, stream: torch.cuda.Stream, head: DecodeHead | None = None):
        self.buckets = buckets
        inputs = buffers.on_device
        device = inputs.input_ids.device
        self.output = torch.zeros(max(buckets), hidden_size, dtype=dtype, device=device)
        # the logits of the buckets that compute them (every bucket up to logits_rows)
        self.logits_rows = min(LOGITS_GRAPH_MAX_ROWS, max(buckets)) if head is not None else 0
        self.logits = torch.zeros(self.logits_rows, head.vocab_size if head else 0, dtype=dtype, device=device)
        self.head = head
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture(run_model, backend, buffers, pool, stream)
        self.draws = None
        if head is not None and buckets[0] <= self.logits_rows:
            sampled = max(bucket for bucket in buckets if bucket <= self.logits_rows)
            self.draws = DrawGraphs(head.sampler, self.logits, inputs.sampling(sampled, False),
                                    inputs.sampled_slots[:sampled], head.mask_table,
                                    [bucket for bucket in buckets if bucket <= self.logits_rows], pool, stream)

    def _forward(self, run_model, input_ids: torch.Tensor, positions: torch.Tensor, rows: int) -> None:
        """A bucket's step into the static buffers: its hidden states, and its logits where it computes them."""
        self.output[:rows] = run_model(input_ids, positions)
        if rows <= self.logits_rows:
            self.logits[:rows] = self.head.compute_logits(self.output[:rows])

    def _capture(self, run_model, backend: AttentionBackend, buffers: StepBuffers, pool,
                 stream: torch.cuda.Stream) -> None:
        # Padding rows everywhere: captured launches touch no real KV while capturing.
        inputs = buffers.on_device
        inputs.input_ids.zero_()
        inputs.positions.zero_()
        inputs.slot_mapping.fill_(-1)
        inputs.context_lens.zero_()
        inputs.block_tables.fill_(-1)
        started = time.perf_counter()
        for i, bs in enumerate(reversed(self.buckets)):  # largest first, so the pool is reused
            input_ids, positions = inputs.input_ids[:bs], inputs.positions[:bs]
            with step_context(buffers.decode_context(backend, bs)):
                self._forward(run_model, input_ids, positions, bs)  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool, stream=stream):
                    self._forward(run_model, input_ids, positions, bs)
            self.graphs[bs] = graph
            if i % 4 == 3 or bs == self.buckets[0]:
                log.info("captured decode graphs %d/%d (batch %d) in %.1fs", i + 1, len(self.buckets), bs,
                         time.perf_counter() - started)
        torch.cuda.synchronize()

    def batch_size(self, num_seqs: int) -> int:
        """The bucket that replays a decode of num_seqs sequences: the smallest that holds them."""
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def replay(self, num_seqs: int) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of the decode step whose inputs are in the step buffers,
        padded to batch_size(num_seqs) rows (build_step_inputs' num_rows)."""
        self.graphs[self.batch_size(num_seqs)].replay()
        return self.output[:num_seqs]

    def logits_of(self, num_seqs: int) -> torch.Tensor | None:
        """The logits [num_seqs, vocab] the last replay of a decode of num_seqs sequences computed; None where
        its bucket leaves them to the caller."""
        return self.logits[:num_seqs] if self.batch_size(num_seqs) <= self.logits_rows else None

    def draw(self, logits: torch.Tensor, batch: SamplingBatch, masks: TokenMasks | None) -> torch.Tensor | None:
        """The tokens of a draw from `logits` replayed from a graph (DrawGraphs.replay); None where the draw is
        not one of theirs: logits other than the graphs' own (a processor's copy, an eager step's), or a kind
        of draw they do not hold."""
        if self.draws is None or logits.data_ptr() != self.logits.data_ptr():
            return None
        return self.draws.replay(len(logits), self.batch_size(len(logits)), batch, masks)


class StepGraphs:
    """Decode and prefill graphs over one pool, captured for the given buckets (the worker captures
    every bucket; sizing the KV cache captures the largest of each to measure the pool)."""

    def __init__(self, run_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], layers: list[Attention],
                 backend: AttentionBackend, buffers: StepBuffers, hidden_size: int, dtype: torch.dtype,
                 decode_buckets: list[int], prefill_buckets: list[int], head: DecodeHead | None = None):
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        # Prefill first: its largest bucket needs the most memory, which every later capture reuses.
        self.prefill = PrefillGraphs(run_model, layers, backend, buffers, hidden_size, dtype, prefill_buckets,
                                     pool, stream)
        self.decode = DecodeGraphs(run_model, backend, buffers, hidden_size, dtype, decode_buckets, pool, stream,
                                   head)

    def num_rows(self, work: StepWork) -> int | None:
        """The rows the step's graphs compute (its bucket); None if it runs eagerly."""
        if work.is_decode:
            return self.decode.batch_size(len(work.slots))
        return self.prefill.num_rows(len(work.token_ids))

    def replay(self, work: StepWork, num_rows: int, context: StepContext) -> torch.Tensor:
        """Hidden states of the step's own rows; its inputs are staged, padded to num_rows."""
        if work.is_decode:
            return self.decode.replay(len(work.slots))
        return self.prefill.replay(num_rows, context, len(work.token_ids))
