"""The one owner of a worker's step tensors: device buffers sized for the largest step, which every
step's kernels read (eager steps, and the decode CUDA graphs, captured over slices of them), and
the host staging buffers that build_step_inputs fills.

A step's inputs reach the device as non_blocking copies from pinned host memory, queued ahead of
its kernels; the host moves on before they run. Steps are pipelined (up to MAX_STEPS_IN_FLIGHT
launched before the oldest is replied to), so a host buffer must not be rewritten while a copy
from it may still be pending. Each step therefore stages into the next of MAX_STEPS_IN_FLIGHT + 1
host sets in turn, and each set records an event after its copies, which its next use waits for.
The ring makes that wait free in the worker loop (the step that last used a set has been replied
to, so its copies are long done); the event keeps callers that launch without replying
(step_logits, benches) correct. On CPU the device buffers are host memory already and a step's
work is done when its launch returns: the device buffers are the one staging set, and nothing is
copied.

The device buffers need no such care: a step's copies and kernels are queued in order on one
stream, so its copies land after the previous step's kernels have read the buffers.

So a block table has three forms: the sequence table's numpy rows (host state), a staging set's
pinned rows, and the device rows the kernels read.
"""
from types import SimpleNamespace

import torch

from nanoserve_kernels.backend import AttentionBackend
from nanoserve_model.sampler import SamplingBatch, SamplingColumns
from nanoserve_model.step_context import StepContext
from nanoserve.mathutil import cdiv
from worker_svc.launched_step import MAX_STEPS_IN_FLIGHT


class StepTensors:
    """Every input tensor of a step at the largest step's size, either on the device or as one set
    of host staging buffers. Each host-to-device copy costs the GPU ~3 us however small (an H100
    timeline of a 0.6B batch-1 decode step, ~1 ms, showed six of them, ~2 us apart). So the tensors
    lie in four buffers, each read by one copy of its front: the int64 per-sequence rows (sampling
    and feeding indices) with the positions, the int32 ones (lengths) with the block tables, the
    slot mapping, and the token ids, which a pipelined decode does not copy at all: every row is
    gathered from the last sampled tokens on the device."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 pin: bool):
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        self.input_ids = zeros(max_tokens, dtype=torch.int64)
        self.slot_mapping = zeros(max_tokens, dtype=torch.int64)
        # int64: seven rows of sampled and fed indices, then the positions; int32: three rows of lengths
        # and the decode order (context_lens and decode_order have one spare entry, so the four are
        # equally long), then the block tables. Each part starts 16-byte aligned, as Triton specializes on it.
        self._positions_at, self._tables_at = _aligned(7 * max_seqs, 2), _aligned(4 * (max_seqs + 1), 4)
        self.int64_rows = zeros(self._positions_at + max_tokens, dtype=torch.int64)
        self.indices = self.int64_rows[:7 * max_seqs].view(7, max_seqs)
        (self.sample_indices, self.sampled_slots, self.fed_rows, self.fed_slots, self.sample_keys,
         self.sample_counters, temperature_bits) = self.indices
        # The sampled rows' temperatures ride in the same copy, as float64 over the last row's bits.
        self.sample_temperatures = temperature_bits.view(torch.float64)
        self.positions = self.int64_rows[self._positions_at:]
        self.int32_rows = zeros(self._tables_at + max_seqs * max_blocks_per_seq, dtype=torch.int32)
        self.lengths = self.int32_rows[:4 * (max_seqs + 1)].view(4, max_seqs + 1)
        self.context_lens, self.cu_seqlens_q, self.cu_seqlens_k, self.decode_order = self.lengths
        self.block_tables = self.int32_rows[self._tables_at:].view(max_seqs, max_blocks_per_seq)

    def copy_from(self, staged: "StepTensors", num_tokens: int, num_slots: int, num_seqs: int, num_fed: int
                  ) -> None:
        """non_blocking copies of what a step uses: its sequences' rows and positions, the slot mapping
        over `num_slots` rows (CUDA-graph padding included), and its token ids unless every one is fed
        from the last sampled tokens (num_fed == num_tokens)."""
        counts = ((self.int64_rows, self._positions_at + num_tokens),
                  (self.int32_rows, self._tables_at + num_seqs * self.block_tables.shape[1]),
                  (self.slot_mapping, num_slots),
                  (self.input_ids, 0 if num_fed == num_tokens else num_tokens))
        for (dst, count), src in zip(counts, (staged.int64_rows, staged.int32_rows, staged.slot_mapping,
                                               staged.input_ids)):
            if count:
                dst[:count].copy_(src[:count], non_blocking=True)

    def sampling(self, num_sampled: int, all_greedy: bool) -> SamplingBatch:
        """The sampled rows' parameters (Sampler.stage writes them into a staging set)."""
        return SamplingBatch(self.sample_temperatures[:num_sampled], self.sample_keys[:num_sampled],
                             self.sample_counters[:num_sampled], all_greedy)


def _aligned(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


class StagingSet:
    """One set of host staging buffers (pinned on CUDA), with numpy views of the same memory under
    the same names for build_step_inputs to fill, and the event after the copies out of it (recorded
    on `stream`, the one steps queue on; None on CPU)."""

    def __init__(self, tensors: StepTensors, stream: "torch.cuda.Stream | None"):
        self.tensors = tensors
        self.arrays = SimpleNamespace(**{name: t.numpy() for name, t in vars(tensors).items()
                                         if isinstance(t, torch.Tensor)})
        self.sampling = SamplingColumns(self.arrays.sample_temperatures, self.arrays.sample_keys,
                                        self.arrays.sample_counters)
        self.stream = stream
        self.copied = torch.cuda.Event() if stream is not None else None
        self.pending = False

    def wait_copied(self) -> None:
        if self.pending:
            self.copied.synchronize()
            self.pending = False

    def record_copied(self) -> None:
        if self.copied is not None:
            self.copied.record(self.stream)
            self.pending = True


class StepBuffers:
    """The device step tensors and their host staging sets, sized for the worker's largest step
    (max_num_batched_tokens tokens, max_num_seqs sequences, tables as wide as max_model_len needs)."""

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.max_num_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.max_model_len, self.block_size = max_model_len, block_size
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        sizes = (max_num_batched_tokens, max_num_seqs, self.max_blocks_per_seq)
        self.on_device = StepTensors(*sizes, device, pin=False)
        if device.type == "cuda":
            stream = torch.cuda.default_stream(device)
            self._staging = [StagingSet(StepTensors(*sizes, torch.device("cpu"), pin=True), stream)
                             for _ in range(MAX_STEPS_IN_FLIGHT + 1)]
        else:
            self._staging = [StagingSet(self.on_device, None)]
        self._turn = 0
        self._decode_contexts: dict[tuple[AttentionBackend, int], StepContext] = {}

    def next_staging(self) -> StagingSet:
        """The host set for the next step, once the copies out of it from its last use are done."""
        staging = self._staging[self._turn]
        self._turn = (self._turn + 1) % len(self._staging)
        staging.wait_copied()
        return staging

    def upload(self, staging: StagingSet, num_tokens: int, num_slots: int, num_seqs: int, num_fed: int) -> None:
        """Queues the copies of a filled staging set to the device buffers (StepTensors.copy_from)."""
        if staging.tensors is not self.on_device:
            self.on_device.copy_from(staging.tensors, num_tokens, num_slots, num_seqs, num_fed)
            staging.record_copied()

    def context(self, backend: AttentionBackend, is_prefill: bool, num_tokens: int, num_seqs: int,
                table_width: int, max_seqlen_q: int, max_seqlen_k: int, num_decodes: int = 0) -> StepContext:
        """The attention context over the device buffers' first rows; in a mixed step, varlen lengths
        from its first entry after num_decodes leading decodes (build_step_inputs writes them so)."""
        t = self.on_device
        return StepContext(backend=backend, is_prefill=is_prefill, slot_mapping=t.slot_mapping[:num_tokens],
                           context_lens=t.context_lens[:num_seqs], block_tables=t.block_tables[:num_seqs, :table_width],
                           cu_seqlens_q=t.cu_seqlens_q[num_decodes:num_seqs + 1],
                           cu_seqlens_k=t.cu_seqlens_k[num_decodes:num_seqs + 1],
                           max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, num_decodes=num_decodes,
                           decode_order=t.decode_order[:num_decodes if is_prefill else num_seqs])

    def prefill_graph_context(self, backend: AttentionBackend, num_rows: int) -> StepContext:
        """The context a piecewise prefill graph of num_rows tokens is captured under: its K/V store
        reads the slot mapping's first num_rows entries; its attention is cut out of the graph
        (worker_svc.prefill_graphs), so the lengths are placeholders that no kernel reads."""
        return self.context(backend, True, num_rows, 1, 1, 1, 1)

    def decode_context(self, backend: AttentionBackend, num_seqs: int) -> StepContext:
        """A decode step's context, the same for an eager step as for the CUDA graph of its batch
        size: full-width block tables (a kernel such as flash-attn's picks its split of the context
        from the table width) and length bounds instead of this step's lengths. Made once per size."""
        key = (backend, num_seqs)
        if key not in self._decode_contexts:
            self._decode_contexts[key] = self.context(backend, False, num_seqs, num_seqs, self.max_blocks_per_seq, 1,
                                                      self.max_model_len)
        return self._decode_contexts[key]
