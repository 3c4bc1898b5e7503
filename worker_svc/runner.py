"""The model runner of one worker rank.

Steps are launched, not run: the device work is queued and the call returns, so the worker can
queue the next step before this one's tokens are read back. Sampled tokens stay on the device
as well, where the next decode of their sequence reads them (every rank gets rank 0's)."""
import hashlib
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from kernels.backend import select_backend
from model.checkpoint import CONFIG_FILES, weight_files
from model.compiled import configure_compiler
from model.config import ModelConfig, resolve_dtype
from model.loader import load_model
from model.parallel import broadcast_from_first_rank, tp_rank, tp_world_size
from model.registry import read_model_config
from model.sampler import Sampler, SamplingRow
from model.step_context import step_context
from nanoserve.hub import resolve_model_dir
from nanoserve.mathutil import cdiv
from nanoserve.v1 import worker_pb2
from worker_svc.config import WorkerConfig
from worker_svc.cuda_graphs import DecodeGraphs
from worker_svc.distributed import uses_cuda
from worker_svc.launched_step import LaunchedStep, StepClock
from worker_svc.sampling_extras import SamplingExtras
from worker_svc.sequence_table import SequenceTable, StepWork
from worker_svc.step_buffers import StepBuffers
from worker_svc.step_inputs import StepInputs, build_step_inputs

log = logging.getLogger("nanoserve.worker")


def model_fingerprint(path: Path, dtype: torch.dtype, load_format: str) -> str:
    """Equal on ranks that serve the same checkpoint (or the same dummy weights) in the same dtype."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")) if load_format != "dummy" else ():
        digest.update(f"{file.name}:{file.stat().st_size}".encode())
    digest.update(f"{dtype} dummy={load_format == 'dummy'}".encode())
    return digest.hexdigest()[:16]


def fetch_checkpoint(config: WorkerConfig) -> tuple[Path, ModelConfig]:
    """The checkpoint's directory and config. A Hub model's config comes first and is checked (an
    architecture or feature nanoserve cannot serve is an error before any weight is fetched); then come
    the weight files the loader will read, unless the weights are dummy."""
    path = resolve_model_dir(config.model, CONFIG_FILES, config.revision, config.download_dir)
    model_config = read_model_config(path)
    if config.load_format != "dummy":
        path = resolve_model_dir(config.model, weight_files(path), config.revision, config.download_dir)
    return path, model_config


class ModelRunner:
    """One rank's model at work: its shard of the weights, the KV cache, the sequence table, the
    step buffers and, on CUDA, the decode graphs. Each step message (worker.proto StepRequest) is
    validated against the sequence table, staged into the step buffers, run through one forward
    pass and, on rank 0, sampled.

    Construction is the worker's start-up: it makes the process settings the model needs, loads
    the weights, and (on CUDA) runs a warm-up step to learn how many KV blocks fit; the KV cache
    itself waits for allocate_kv_cache, which takes the block count every rank agreed on."""

    def __init__(self, config: WorkerConfig):
        configure_compiler()
        self.config = config
        if (tp_rank(), tp_world_size()) != (config.rank, config.tensor_parallel_size):
            raise ValueError(f"rank {config.rank} of {config.tensor_parallel_size} was asked for, but this "
                             f"process is rank {tp_rank()} of {tp_world_size()} in torch.distributed")
        self.device = (torch.device("cuda", torch.cuda.current_device()) if uses_cuda(config)
                       else torch.device("cpu"))
        path, self.model_config = fetch_checkpoint(config)
        self.dtype = resolve_dtype(config.dtype, self.model_config)
        self.max_model_len = self.model_config.context_limit(config.max_model_len)
        self.backend = select_backend(config.attention_backend, self.device.type, config.block_size)
        self.model = load_model(path, self.model_config, self.dtype, self.device, config.load_format)
        self.sampler = Sampler(self.device, config.seed)
        self.fingerprint = model_fingerprint(path, self.dtype, config.load_format)
        self.clock = StepClock(self.device)
        self.kv_cache: torch.Tensor | None = None
        self.seqs: SequenceTable | None = None  # exists once the KV cache does
        self.last_tokens: torch.Tensor | None = None  # [max_num_seqs] each slot's last sampled token
        self.graphs: DecodeGraphs | None = None
        self.buffers = StepBuffers(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len,
                                   config.block_size, self.device)
        self.max_kv_blocks = self._max_kv_blocks()
        log.info("rank %d: %s (%s%s) in %s, %s attention, room for %d KV blocks of %d tokens", config.rank,
                 config.model, self.model_config.architecture, ", dummy weights" if config.load_format == "dummy" else "",
                 self.dtype, self.backend.name, self.max_kv_blocks, config.block_size)

    def _kv_block_bytes(self) -> int:
        attn = self.model.attention_layers()[0]
        per_token = 2 * attn.num_kv_heads * attn.head_dim * self.dtype.itemsize  # K and V
        return len(self.model.attention_layers()) * self.config.block_size * per_token

    def _max_kv_blocks(self) -> int:
        """KV blocks this rank can hold: forced by the config, else from the CPU budget, else what
        gpu_memory_utilization of the GPU leaves after the weights and the largest step's activations."""
        if self.config.num_kv_blocks > 0:
            return self.config.num_kv_blocks
        if self.device.type == "cpu":
            return int(self.config.cpu_kv_cache_gb * 2**30 // self._kv_block_bytes())
        activations = self._warm_up()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.gpu_memory_utilization - (total - free) - activations
        return max(0, int(budget // self._kv_block_bytes()))

    @torch.inference_mode()
    def _warm_up(self) -> int:
        """Runs the largest prefill step and the largest sampling batch once on a scratch cache;
        returns the activation memory they peaked at, which the KV pool must leave free."""
        started = time.perf_counter()
        size = self.config.block_size
        seq_len = min(self.max_model_len - 1, self.config.max_num_batched_tokens)
        num_seqs = max(1, min(self.config.max_num_seqs, self.config.max_num_batched_tokens // seq_len))
        blocks = cdiv(seq_len, size)
        self._allocate(num_seqs * blocks)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        step = worker_pb2.StepRequest(seqs=[
            worker_pb2.SeqStep(seq_id=i, token_ids=[0] * seq_len, new_block_ids=range(i * blocks, (i + 1) * blocks),
                               reset=True, sample=True) for i in range(num_seqs)])
        self.step(step)
        hidden = torch.zeros(self.config.max_num_seqs, self.model_config.hidden_size, dtype=self.dtype,
                             device=self.device)
        logits = self.model.compute_logits(hidden)
        if logits is not None:
            self.sampler(logits, [SamplingRow(1.0, None, 0)] * len(hidden))
        del hidden, logits
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.kv_cache = self.seqs = None
        torch.cuda.empty_cache()
        log.info("rank %d: warm-up of %d x %d tokens took %.1fs, peak activations %.2f GiB", self.config.rank,
                 num_seqs, seq_len, time.perf_counter() - started, peak / 2**30)
        return peak

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            model=self.config.model, rank=self.config.rank, world_size=self.config.tensor_parallel_size,
            dtype=str(self.dtype).removeprefix("torch."), block_size=self.config.block_size,
            max_kv_blocks=self.max_kv_blocks, vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len, eos_token_ids=self.model_config.eos_token_ids,
            attention_backend=self.backend.name, device=str(self.device),
            max_num_seqs=self.config.max_num_seqs, max_num_batched_tokens=self.config.max_num_batched_tokens,
            model_fingerprint=self.fingerprint, sampling_defaults=self._sampling_defaults())

    def _sampling_defaults(self) -> worker_pb2.SamplingDefaults:
        """generation_config.json's values, the ones it sets (unset fields stay unset on the wire)."""
        values = asdict(self.model_config.sampling_defaults)
        return worker_pb2.SamplingDefaults(**{name: value for name, value in values.items() if value is not None})

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocates the cache and, on CUDA, captures the decode graphs over it; any sequence
        state refers to the old cache and is dropped."""
        if not 0 < num_blocks <= self.max_kv_blocks:
            raise ValueError(f"cannot allocate {num_blocks} KV blocks: this rank holds 1 to {self.max_kv_blocks}")
        self.graphs = None
        self._bind_device()
        self._allocate(num_blocks)
        if self.device.type == "cuda" and not self.config.enforce_eager:
            started = time.perf_counter()
            self.graphs = DecodeGraphs(self._run_model, self.backend, self.buffers,
                                       self.model_config.hidden_size, self.dtype)
            log.info("rank %d: captured %d decode graphs in %.1fs", self.config.rank, len(self.graphs.buckets),
                     time.perf_counter() - started)

    def _allocate(self, num_blocks: int) -> None:
        self.kv_cache = self.seqs = None  # release the old cache before taking memory for the new one
        layers = self.model.attention_layers()
        self.kv_cache = torch.empty(2, len(layers), num_blocks, self.config.block_size, layers[0].num_kv_heads,
                                    layers[0].head_dim, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.bind_kv_cache(self.kv_cache[0, i], self.kv_cache[1, i])
        self.seqs = SequenceTable(self.config.max_num_seqs, num_blocks, self.config.block_size,
                                  self.model_config.vocab_size, self.max_model_len)
        self.extras = SamplingExtras(self.config.max_num_seqs, self.model_config.vocab_size,
                                     tuple(self.model_config.eos_token_ids), self.device, samples=tp_rank() == 0)
        self.last_tokens = torch.zeros(self.config.max_num_seqs, dtype=torch.int64, device=self.device)

    def _bind_device(self) -> None:
        """gRPC calls arrive on pool threads, and the current CUDA device is per thread: kernels,
        streams and graph captures must all land on this rank's GPU."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @torch.inference_mode()
    def launch(self, request: worker_pb2.StepRequest) -> LaunchedStep:
        """Queues the step's work and returns; its reply() waits for the work and carries the
        sampled tokens: one per entry with `sample` set, in entry order, on rank 0 ([] elsewhere)."""
        host_started = time.perf_counter()
        self._bind_device()
        work = self._apply(request)
        start = self.clock.mark()  # after the host-only part: a device that waits for it shows idle
        logits, inputs = self._compute(work)
        tokens = None
        if inputs is not None and inputs.sampling:
            tokens = (self.sampler(self.extras.process(logits, work, inputs.sampled_slots), inputs.sampling)
                      if logits is not None else
                      torch.empty(len(inputs.sampling), dtype=torch.int64, device=self.device))
            broadcast_from_first_rank(tokens)
            self.last_tokens[inputs.sampled_slots] = tokens
        logprobs = self.extras.finish(logits, tokens, inputs and inputs.sampled_slots) if work else None
        return LaunchedStep(self.clock, start, tokens if logits is not None else None, host_started, logprobs)

    def step(self, request: worker_pb2.StepRequest) -> list[int]:
        """launch() and wait: the step's sampled tokens."""
        return list(self.launch(request).reply(request.step_id).token_ids)

    @torch.inference_mode()
    def step_logits(self, request: worker_pb2.StepRequest) -> torch.Tensor | None:
        """Runs the step like step() but returns the logits [sampled entries, vocab] instead."""
        self._bind_device()
        return self._compute(self._apply(request))[0]

    def _apply(self, request: worker_pb2.StepRequest) -> StepWork | None:
        """Validates the step and updates the sequence table (host only); ValueError if refused."""
        if self.seqs is None:
            raise ValueError("step before the KV cache was allocated")
        num_tokens = sum(max(1, len(entry.token_ids)) for entry in request.seqs)
        if len(request.seqs) > self.config.max_num_seqs or num_tokens > self.config.max_num_batched_tokens:
            raise ValueError(f"step of {len(request.seqs)} sequences and {num_tokens} tokens exceeds this "
                             f"worker's limits ({self.config.max_num_seqs} sequences, "
                             f"{self.config.max_num_batched_tokens} tokens)")
        work = self.seqs.apply(request)
        if work is not None and work.resets:
            self.extras.reset(work)
        return work

    def _compute(self, work: StepWork | None) -> tuple[torch.Tensor | None, StepInputs | None]:
        """Queues the forward pass; the logits of the sampled rows on rank 0."""
        if work is None:
            return None, None
        graphs = self.graphs if work.is_decode else None
        num_seqs = len(work.slots)
        num_rows = graphs.batch_size(num_seqs) if graphs is not None else num_seqs
        inputs = build_step_inputs(work, self.seqs.block_tables, self.backend, self.last_tokens, self.buffers,
                                   num_rows)
        if graphs is not None:
            hidden = graphs.replay(num_seqs)
        else:
            with step_context(inputs.context):
                hidden = self._run_model(inputs.input_ids, inputs.positions)
        if work.scored:  # prompt_logprobs; on every rank (a collective with tensor parallelism)
            self.extras.score_prompts(work, hidden, self.model.compute_logits)
        if not inputs.sampling:
            return None, inputs
        return self.model.compute_logits(hidden[inputs.sample_indices]), inputs

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The forward pass under the current step context (the seam for CUDA-graph replay)."""
        return self.model(input_ids, positions)
