"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step launches a few hundred small kernels; replaying a captured graph removes their
launch cost. Every bucket is captured over the first rows of the worker's step buffers, the same
device buffers an eager step reads, so a step's inputs are in place for replay as soon as
build_step_inputs has queued their copies: rows past the live batch are padding the kernels skip
(slot -1, context length 0). Every bucket writes one static output buffer.
"""
import bisect
import logging
from typing import Callable

import torch

from kernels.backend import AttentionBackend
from model.step_context import step_context
from worker_svc.step_buffers import StepBuffers

log = logging.getLogger("nanoserve.worker")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (which is always a bucket)."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + [b for b in range(16, max_num_seqs, 16)] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, run_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 backend: AttentionBackend, buffers: StepBuffers, hidden_size: int, dtype: torch.dtype):
        self.buckets = batch_buckets(buffers.max_num_seqs)
        inputs = buffers.on_device
        self.output = torch.zeros(buffers.max_num_seqs, hidden_size, dtype=dtype, device=inputs.input_ids.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture(run_model, backend, buffers)

    def _capture(self, run_model, backend: AttentionBackend, buffers: StepBuffers) -> None:
        # Padding rows everywhere: captured launches touch no real KV while capturing.
        inputs = buffers.on_device
        inputs.input_ids.zero_()
        inputs.positions.zero_()
        inputs.slot_mapping.fill_(-1)
        inputs.context_lens.zero_()
        inputs.block_tables.fill_(-1)
        pool = torch.cuda.graph_pool_handle()
        for i, bs in enumerate(reversed(self.buckets)):  # largest first, so the pool is reused
            input_ids, positions = inputs.input_ids[:bs], inputs.positions[:bs]
            with step_context(buffers.decode_context(backend, bs)):
                self.output[:bs] = run_model(input_ids, positions)  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.output[:bs] = run_model(input_ids, positions)
            self.graphs[bs] = graph
            if i % 4 == 0 or bs == 1:
                log.info("captured decode graph %d/%d (batch %d)", i + 1, len(self.buckets), bs)
        torch.cuda.synchronize()

    def batch_size(self, num_seqs: int) -> int:
        """The bucket that replays a decode of num_seqs sequences: the smallest that holds them."""
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def replay(self, num_seqs: int) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of the decode step whose inputs are in the step buffers,
        padded to batch_size(num_seqs) rows (build_step_inputs' num_rows)."""
        self.graphs[self.batch_size(num_seqs)].replay()
        return self.output[:num_seqs]
