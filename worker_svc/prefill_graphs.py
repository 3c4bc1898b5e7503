"""Prefill steps (every step that is not a pure decode) replayed from piecewise CUDA graphs, one set
per padded token-count bucket.

Eagerly, a prefill step's forward pass is a few hundred kernel launches and compiled-region entries,
whose host cost dwarfs the GPU work of a short prompt. Everything in it but attention works row by
row over the step's tokens, so it can be captured once per token count and replayed; attention
depends on how the tokens split into sequences (varlen boundaries, grids sized from the longest
one), so it runs eagerly. A bucket's forward pass is therefore captured as num_layers + 1 graphs cut
at each attention layer: the layer stores the step's K/V inside the current graph (the slot mapping
is read from the step buffers), hands its queries to the cut, which copies them into a static
buffer and ends the graph; the next graph begins by reading the layer's output from another static
buffer. A replay runs graph 0, then layer 0's attention over the step's real tokens (this step's
lengths and block tables, from the step buffers) into that output buffer, then graph 1, and so on.

A step of N tokens replays the smallest bucket of at least N rows: rows past N are padding (slot -1,
stale positions and token ids that are valid ones), which the row-wise work computes and nothing
reads, and which attention never sees. Steps larger than the largest bucket run eagerly.
"""
import bisect
import logging
import time
from typing import Callable

import torch

from nanoserve_kernels.backend import AttentionBackend
from nanoserve_model.attention import Attention
from nanoserve_model.step_context import StepContext, step_context
from worker_svc.step_buffers import StepBuffers

log = logging.getLogger("nanoserve.worker")


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, then 1 and 1.5 times each power of two (256, 384, 512, 768, ...), below
    max_tokens, which is always the last bucket: a step pads by less than half its size."""
    buckets, size = [], 16
    while size < max_tokens:
        buckets += [size] if size < 256 else [size, size * 3 // 2]
        size *= 2
    return [b for b in buckets if b < max_tokens] + [max_tokens]


class AttentionBuffers:
    """The static query and output buffers between the pieces, at the largest bucket's size; every
    bucket and every layer uses their first rows."""

    def __init__(self, max_tokens: int, layer: Attention, dtype: torch.dtype, device: torch.device):
        shape = (max_tokens, layer.num_heads, layer.head_dim)
        self.q = torch.zeros(shape, dtype=dtype, device=device)
        self.out = torch.zeros(shape, dtype=dtype, device=device)

    def stage(self, layer: Attention, q: torch.Tensor) -> torch.Tensor:
        """The cut: the queries into the query buffer, where the layer's rotary has written them
        already (StepContext.attention_queries; copied here only when a layer made them elsewhere),
        and the output buffer, which holds the layer's attention output when the graph is replayed
        (stale in a warm-up pass, which only compiles and sizes the work)."""
        if q.data_ptr() != self.q.data_ptr():
            self.q[:len(q)].copy_(q)
        return self.out[:len(q)]

    def attend(self, layer: Attention, context: StepContext, num_tokens: int) -> None:
        """The eager attention of a replay: the step's real tokens' queries, into the output buffer."""
        layer.prefill(self.q[:num_tokens], context, out=self.out[:num_tokens])


class _PieceCapture:
    """The attention cut while one bucket is captured: at each attention layer, ends the graph being
    captured and begins the next one in the same pool."""

    def __init__(self, buffers: AttentionBuffers, pool):
        self.buffers, self.pool = buffers, pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.layers: list[Attention] = []

    def begin(self) -> None:
        self.graphs.append(torch.cuda.CUDAGraph())
        self.graphs[-1].capture_begin(self.pool)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def __call__(self, layer: Attention, q: torch.Tensor) -> torch.Tensor:
        out = self.buffers.stage(layer, q)  # the copy is the last work of this piece
        self.end()
        self.layers.append(layer)
        self.begin()
        return out


class PrefillGraphs:
    def __init__(self, run_model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], layers: list[Attention],
                 backend: AttentionBackend, buffers: StepBuffers, hidden_size: int, dtype: torch.dtype,
                 buckets: list[int], pool, stream: torch.cuda.Stream):
        self.buckets = buckets
        device = buffers.on_device.input_ids.device
        max_tokens = max(buckets)
        self.attention = AttentionBuffers(max_tokens, layers[0], dtype, device)
        self.output = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.layers: list[Attention] = []  # in the order the pieces cut them
        self._capture(run_model, backend, buffers, pool, stream)

    def _capture(self, run_model, backend: AttentionBackend, buffers: StepBuffers, pool,
                 stream: torch.cuda.Stream) -> None:
        inputs = buffers.on_device
        inputs.slot_mapping.fill_(-1)  # padding everywhere: the captured stores touch no real KV
        started = time.perf_counter()
        for i, rows in enumerate(reversed(self.buckets)):  # largest first, so the pool is reused
            input_ids, positions = inputs.input_ids[:rows], inputs.positions[:rows]
            context = buffers.prefill_graph_context(backend, rows)
            context.attention_queries = self.attention.q
            with step_context(context):  # warm-up: every compiled function meets this shape now
                context.attention_cut = self.attention.stage
                self.output[:rows] = run_model(input_ids, positions)
            torch.cuda.synchronize()
            capture = _PieceCapture(self.attention, pool)
            with torch.cuda.stream(stream), step_context(context):
                context.attention_cut = capture
                capture.begin()
                self.output[:rows] = run_model(input_ids, positions)
                capture.end()
            if self.layers and capture.layers != self.layers:
                raise RuntimeError("the forward pass cut its attention layers in another order")
            self.layers, self.pieces[rows] = capture.layers, capture.graphs
            if i % 4 == 3 or rows == self.buckets[0]:
                log.info("captured prefill graphs %d/%d (%d tokens, %d pieces each) in %.1fs", i + 1,
                         len(self.buckets), rows, len(capture.graphs), time.perf_counter() - started)
        torch.cuda.synchronize()

    def num_rows(self, num_tokens: int) -> int | None:
        """The bucket that replays a step of num_tokens tokens; None if it is too large for any."""
        index = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[index] if index < len(self.buckets) else None

    def replay(self, num_rows: int, context: StepContext, num_tokens: int) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the step whose inputs are in the step buffers,
        padded to num_rows rows (build_step_inputs' num_rows); `context` is the step's own."""
        pieces = self.pieces[num_rows]
        pieces[0].replay()
        for layer, piece in zip(self.layers, pieces[1:]):
            self.attention.attend(layer, context, num_tokens)
            piece.replay()
        return self.output[:num_tokens]
