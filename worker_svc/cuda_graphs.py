"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step launches a few hundred small kernels; replaying a captured graph removes their
launch cost. Every bucket reads the same static input buffers, padded past the live batch with
rows the kernels skip (slot -1, context length 0), and writes one static output buffer.
"""
import bisect
import logging
from typing import Callable

import torch

from kernels.backend import AttentionBackend
from worker_svc.context import StepContext, step_context

log = logging.getLogger("nanoserve.worker")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (which is always a bucket)."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + [b for b in range(16, max_num_seqs, 16)] + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, run_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 backend: AttentionBackend, max_num_seqs: int, max_blocks_per_seq: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.buckets = batch_buckets(max_num_seqs)
        n = max_num_seqs

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids, self.positions = zeros(n), zeros(n)
        self.slot_mapping = zeros(n)
        self.context_lens = zeros(n, dtype=torch.int32)
        self.block_tables = zeros(n, max_blocks_per_seq, dtype=torch.int32)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.output = zeros(n, hidden_size, dtype=dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture(run_model, backend)

    def _context(self, backend: AttentionBackend, bs: int) -> StepContext:
        return StepContext(backend=backend, is_prefill=False, slot_mapping=self.slot_mapping[:bs],
                           context_lens=self.context_lens[:bs], block_tables=self.block_tables[:bs],
                           cu_seqlens_q=self.cu_seqlens_q[: bs + 1])

    def _capture(self, run_model, backend: AttentionBackend) -> None:
        # Padding rows everywhere: captured launches touch no real KV while capturing.
        self.slot_mapping.fill_(-1)
        self.block_tables.fill_(-1)
        pool = torch.cuda.graph_pool_handle()
        for i, bs in enumerate(reversed(self.buckets)):  # largest first, so the pool is reused
            with step_context(self._context(backend, bs)):
                self.output[:bs] = run_model(self.input_ids[:bs], self.positions[:bs])  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.output[:bs] = run_model(self.input_ids[:bs], self.positions[:bs])
            self.graphs[bs] = graph
            if i % 4 == 0 or bs == 1:
                log.info("captured decode graph %d/%d (batch %d)", i + 1, len(self.buckets), bs)
        torch.cuda.synchronize()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: StepContext) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode step of n <= max_batch sequences."""
        n = input_ids.shape[0]
        bs = self.buckets[bisect.bisect_left(self.buckets, n)]
        width = context.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(context.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.context_lens[:n].copy_(context.context_lens)
        self.context_lens[n:bs].fill_(0)
        self.block_tables[:n, :width].copy_(context.block_tables)
        self.graphs[bs].replay()
        return self.output[:n]
