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
"""
import bisect
import logging
import time
from typing import Callable

import torch

from nanoserve_kernels.backend import AttentionBackend
from nanoserve_model.attention import Attention
from nanoserve_model.step_context import StepContext, step_context
from worker_svc.prefill_graphs import PrefillGraphs
from worker_svc.sequence_table import StepWork
from worker_svc.step_buffers import StepBuffers

log = logging.getLogger("nanoserve.worker")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (which is always a bucket)."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + [b for b in range(16, max_num_seqs, 16)] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, run_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 backend: AttentionBackend, buffers: StepBuffers, hidden_size: int, dtype: torch.dtype,
                 buckets: list[int], pool, stream: torch.cuda.Stream):
        self.buckets = buckets
        inputs = buffers.on_device
        self.output = torch.zeros(max(buckets), hidden_size, dtype=dtype, device=inputs.input_ids.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture(run_model, backend, buffers, pool, stream)

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
                self.output[:bs] = run_model(input_ids, positions)  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool, stream=stream):
                    self.output[:bs] = run_model(input_ids, positions)
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


class StepGraphs:
    """Decode and prefill graphs over one pool, captured for the given buckets (the worker captures
    every bucket; sizing the KV cache captures the largest of each to measure the pool)."""

    def __init__(self, run_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], layers: list[Attention],
                 backend: AttentionBackend, buffers: StepBuffers, hidden_size: int, dtype: torch.dtype,
                 decode_buckets: list[int], prefill_buckets: list[int]):
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        # Prefill first: its largest bucket needs the most memory, which every later capture reuses.
        self.prefill = PrefillGraphs(run_model, layers, backend, buffers, hidden_size, dtype, prefill_buckets,
                                     pool, stream)
        self.decode = DecodeGraphs(run_model, backend, buffers, hidden_size, dtype, decode_buckets, pool, stream)

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
