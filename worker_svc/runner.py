"""The model runner of one worker rank.

Steps are launched, not run: the device work is queued and the call returns, so the worker can
queue the next step before this one's tokens are read back. Sampled tokens stay on the device
as well, where the next decode of their sequence reads them (every rank gets rank 0's)."""
import gc
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from nanoserve_kernels.backend import select_backend
from nanoserve_kernels.compile_watch import warn_on_compiles
from nanoserve_kernels.fp8_reference import FP8_DTYPE
from nanoserve_kernels.kv_quant import bytes_per_row, is_quantized, kv_cache_dtype, scales_shape
from nanoserve_kernels.token_bitmask import TokenMasks
from nanoserve_model.checkpoint import CONFIG_FILES, weight_files
from nanoserve_model.config import ModelConfig, resolve_dtype
from nanoserve_model.deepgemm_ahead import compile_deepgemm_ahead
from nanoserve_model.fp8_bf16_layers import serve_faster_layers_in_bf16
from nanoserve_model.loader import load_model
from nanoserve_model.parallel import broadcast_from_first_rank, tp_rank, tp_world_size
from nanoserve_model.quantization import serving_scheme
from nanoserve_model.registry import read_model_config
from nanoserve_model.sampler import Sampler, SamplingBatch
from nanoserve_model.step_context import step_context
from nanoserve.checkpoint import TOKENIZER_FILE
from nanoserve.grammar_tokenizer import GrammarTokenizer
from nanoserve.hub import resolve_model_dir
from nanoserve.mathutil import cdiv
from nanoserve.step_rows import StepEntry, num_rows, pack_step
from nanoserve.v1 import llm_pb2, worker_pb2
from nanoserve.wire import STEP_FORMAT
from worker_svc.config import WorkerConfig
from worker_svc.cuda_graphs import DecodeHead, StepGraphs, batch_buckets
from worker_svc.distributed import all_ranks_agree, uses_cuda
from worker_svc.fingerprints import kv_sizing, model_fingerprint
from worker_svc.grammar_masks import GrammarMasks
from worker_svc.launched_step import LaunchedStep, StepClock
from worker_svc.platform_info import describe_platform
from worker_svc.prefill_graphs import token_buckets
from worker_svc.sampling_extras import SamplingExtras
from worker_svc.sequence_table import SequenceTable, StepWork
from worker_svc.startup_phases import StartupPhases
from worker_svc.step_buffers import StepBuffers
from worker_svc.step_inputs import StepInputs, build_step_inputs

log = logging.getLogger("nanoserve.worker")

# Prefill and mixed steps up to this many tokens replay graphs (the default step budget); larger
# steps run eagerly. An eager step costs ~36 ms of host time in the worker process, more than the
# GPU needs for 4,000 tokens: with buckets only up to 2,048, a 4,000-token prompt's first token took
# 41 ms on the H100 (nano-vllm: 35). The larger buckets hold ~0.3 GiB more on the 0.6B shape and
# leave the throughput workload as it was (17.5k vs 17.8k tok/s, bench/RESULTS.md).
PREFILL_GRAPH_MAX_TOKENS = 8192


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
    step buffers and, on CUDA, the step graphs (decode and prefill). Each step message (worker.proto
    StepRequest) is validated against the sequence table, staged into the step buffers, run through
    one forward pass and, on rank 0, sampled.

    Construction is the worker's start-up: it loads the weights. At the handshake the KV room is
    sized (size_kv_cache): on CUDA, by measuring what serving needs beside the KV cache, unless the
    scheduler offers the pool its previous group of this configuration served with; the KV cache
    itself waits for allocate_kv_cache, which takes the block count every rank agreed on, and
    captures the graphs over it."""

    def __init__(self, config: WorkerConfig, phases: StartupPhases | None = None):
        self.config = config
        self.phases = phases or StartupPhases()
        if (tp_rank(), tp_world_size()) != (config.rank, config.tensor_parallel_size):
            raise ValueError(f"rank {config.rank} of {config.tensor_parallel_size} was asked for, but this "
                             f"process is rank {tp_rank()} of {tp_world_size()} in torch.distributed")
        self.device = (torch.device("cuda", torch.cuda.current_device()) if uses_cuda(config)
                       else torch.device("cpu"))
        self.platform = describe_platform(self.device)
        log.info("rank %d runs on %s", config.rank, self.platform)
        self.phases.end("distributed+CUDA")
        path, self.model_config = fetch_checkpoint(config)
        self.dtype = resolve_dtype(config.dtype, self.model_config)
        self.max_model_len = self.model_config.context_limit(config.max_model_len)
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.backend = select_backend(config.attention_backend, self.device.type, config.block_size,
                                      is_quantized(self.kv_dtype))
        if is_quantized(self.kv_dtype) and self.backend.name == "triton":
            log.info("rank %d: FP8 KV cache: attention runs on the triton backend (flash-attn cannot read FP8)",
                     config.rank)
        self.quantization = serving_scheme(config.quantization, self.model_config.quantization)
        self.model = load_model(path, self.model_config, self.dtype, self.device, config.load_format,
                                self.quantization)
        self.bf16_layers = None  # FP8 layers this GPU serves faster dequantized
        if self.quantization is not None and self.device.type == "cuda":
            device_name = torch.cuda.get_device_name(self.device)
            self.bf16_layers = serve_faster_layers_in_bf16(self.model, device_name, self.dtype)
            if self.bf16_layers.names:
                log.info("rank %d: %s", config.rank, self.bf16_layers.log_line(device_name))
            compile_deepgemm_ahead(self.model, self.dtype, config.rank)
        self.sampler = Sampler(self.device, config.seed)
        # Rank 0's grammar engine reads the checkpoint's tokenizer, once the first constrained request comes.
        self.grammar_tokenizer = GrammarTokenizer(path / TOKENIZER_FILE, self.model_config.vocab_size,
                                                  tuple(self.model_config.eos_token_ids))
        self.fingerprint = model_fingerprint(path, self.dtype, self.kv_dtype, config.load_format,
                                             self._quantization_name())
        self.clock = StepClock(self.device)
        self.kv_cache: torch.Tensor | None = None  # [K/V, layer, block, offset, kv head, dim]
        self.kv_scales: torch.Tensor | None = None  # FP8 only: [K/V, layer, block, kv head, offset] float32
        self.seqs: SequenceTable | None = None  # exists once the KV cache does
        self.last_tokens: torch.Tensor | None = None  # [max_num_seqs] each slot's last sampled token
        self.graphs: StepGraphs | None = None
        self.buffers = StepBuffers(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len,
                                   config.block_size, self.device)
        self.phases.end("weights")
        self.kv_sizing = kv_sizing(self.fingerprint, self.platform, self.device, config, self.max_model_len,
                                   self.backend.name)
        self._max_kv_blocks: int | None = None  # sized at the handshake (size_kv_cache)
        self._kv_profiled = False  # whether sizing ran the profiling forward (which warms the sampler up)
        log.info("rank %d: %s (%s%s) in %s, weights in %s%s, %s attention", config.rank, config.model,
                 self.model_config.architecture, ", dummy weights" if config.load_format == "dummy" else "",
                 self.dtype, self._weight_dtype(), f" ({self._quantization_name()})" if self.quantization else "",
                 self.backend.name)

    @property
    def kv_sized(self) -> bool:
        return self._max_kv_blocks is not None

    @property
    def max_kv_blocks(self) -> int:
        """KV blocks this rank can hold; sized on first use unless size_kv_cache came first."""
        if self._max_kv_blocks is None:
            self.size_kv_cache()
        return self._max_kv_blocks

    def size_kv_cache(self, offered: int = 0) -> None:
        """Sizes the KV room once: `offered`, the pool a previous group of this rank's configuration
        served with (the scheduler offers it back after a restart, for an equal kv_sizing), else
        measured (_measure_kv_blocks: on CUDA, a profiling forward and a graph capture); ValueError
        when nothing is left for the cache. The ranks of a group take the offer together or measure
        together: the profiling forward and the sampler's warm-up run collectives every rank must join."""
        if self._max_kv_blocks is not None:
            return
        if self.config.tensor_parallel_size > 1:
            self._bind_device()
            offered = offered if all_ranks_agree(offered > 0, self.device) else 0
        self._max_kv_blocks = offered or self._measure_kv_blocks()
        self.phases.end("KV profile")
        log.info("rank %d: room for %d KV blocks of %d tokens in %s (%s)", self.config.rank, self._max_kv_blocks,
                 self.config.block_size, self.kv_dtype,
                 "as its scheduler's previous group had it: not measured again" if offered else "sized here")

    def _weight_dtype(self) -> str:
        """The linear layers' weights as held: e4m3, or (unquantized, or dequantized at load) the model dtype."""
        dtypes = {param.dtype for param in self.model.parameters()}
        return str(FP8_DTYPE if FP8_DTYPE in dtypes else self.dtype).removeprefix("torch.")

    def _quantization_name(self) -> str:
        if self.quantization is None:
            return ""
        if self.bf16_layers is not None and self.bf16_layers.names:
            return f"{self.quantization.describe()}, {self.bf16_layers.describe()}"
        dequantized = self._weight_dtype() != "float8_e4m3fn"
        return self.quantization.describe() + (", dequantized at load" if dequantized else "")

    def _kv_block_bytes(self) -> int:
        attn = self.model.attention_layers()[0]
        per_token = 2 * attn.num_kv_heads * bytes_per_row(self.kv_dtype, attn.head_dim)  # K and V, FP8 scales too
        return len(self.model.attention_layers()) * self.config.block_size * per_token

    def _measure_kv_blocks(self) -> int:
        """KV blocks this rank can hold: forced by the config, else from the CPU budget, else what
        gpu_memory_utilization of the GPU leaves after the weights and _memory_beside_kv_cache."""
        if self.config.num_kv_blocks > 0:
            return self.config.num_kv_blocks
        if self.device.type == "cpu":
            return int(self.config.cpu_kv_cache_gb * 2**30 // self._kv_block_bytes())
        beside = self._memory_beside_kv_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        allowed = total * self.config.gpu_memory_utilization
        blocks = int((allowed - (total - free) - beside) // self._kv_block_bytes())
        if blocks <= 0:
            raise ValueError(f"no room for the KV cache: --gpu-memory-utilization {self.config.gpu_memory_utilization} "
                             f"allows {allowed / 2**30:.1f} GiB of this GPU's {total / 2**30:.1f}, and the weights (with "
                             f"anything else on the GPU) hold {(total - free) / 2**30:.1f} and serving needs "
                             f"{beside / 2**30:.1f} beside them; raise --gpu-memory-utilization, lower "
                             "--max-num-batched-tokens, or split the model over more GPUs (--tensor-parallel-size)")
        return blocks

    @torch.inference_mode()
    def _memory_beside_kv_cache(self) -> int:
        """The device memory that serving needs beside the weights and the KV cache, measured over a
        scratch cache: the peak of the largest eager prefill step, or, with CUDA graphs, of their
        static buffers and memory pool (the largest decode and prefill buckets captured once; the
        smaller ones reuse that pool) under the largest sampling batch, processed as the costliest
        requests would (SamplingExtras.heaviest); plus what the capture took
        outside torch's allocator (graph executables, kernel modules, library workspaces). Doubles
        as the warm-up: the eager step and the sampler compile their kernels here."""
        self._kv_profiled = True
        started = time.perf_counter()
        size = self.config.block_size
        seq_len = min(self.max_model_len - 1, self.config.max_num_batched_tokens)
        num_seqs = max(1, min(self.config.max_num_seqs, self.config.max_num_batched_tokens // seq_len))
        blocks = cdiv(seq_len, size)
        self._allocate(num_seqs * blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base, free_before = torch.cuda.memory_reserved(self.device), torch.cuda.mem_get_info(self.device)[0]
        self.step(pack_step(0, [StepEntry(i, [0] * seq_len, sample=True, reset=True,
                                          new_block_ids=range(i * blocks, (i + 1) * blocks)) for i in range(num_seqs)]))
        torch.cuda.empty_cache()  # the eager step's activations go: the graphs' pool replaces them
        graphs = self._capture_graphs([self.config.max_num_seqs],
                                    [min(self.config.max_num_batched_tokens, PREFILL_GRAPH_MAX_TOKENS)])
        self._warm_up_sampling()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_reserved(self.device) - base
        reserved = torch.cuda.memory_reserved(self.device) - base
        outside = max(0, free_before - torch.cuda.mem_get_info(self.device)[0] - reserved)
        del graphs
        self._release_kv_cache()
        gc.collect()  # the graphs and their pool must be gone before the cache is sized
        torch.cuda.empty_cache()
        log.info("rank %d: measured %.2f GiB beside the KV cache (step peak %.2f, outside torch %.2f) in %.1fs",
                 self.config.rank, (peak + outside) / 2**30, peak / 2**30, outside / 2**30,
                 time.perf_counter() - started)
        return peak + outside

    def _warm_up_sampling(self) -> None:
        """Compiles the sampler's kernels (and the grammar masks') for every row count now, not while serving."""
        hidden = torch.zeros(self.config.max_num_seqs, self.model_config.hidden_size, dtype=self.dtype,
                             device=self.device)
        logits = self.model.compute_logits(hidden)
        if logits is not None:
            self.sampler.warm_up(logits)  # every row count, in the logits' own dtype as serving sees them
            self.sampler.warm_up(self.extras.heaviest(logits))  # and in float32, as the extras hand them on
            if self.extras.grammar is not None:  # the mask kernel, and the race under masks
                self.sampler.warm_up(logits, self.extras.grammar.warm_up(logits))

    def _capture_graphs(self, decode_buckets: list[int], prefill_buckets: list[int]) -> StepGraphs | None:
        """The step graphs for these buckets over the current cache; None where steps run eagerly
        (CPU, --enforce-eager, a backend that cannot be captured)."""
        if self.device.type != "cuda" or self.config.enforce_eager or not self.backend.graph_safe:
            return None
        head = None
        if tp_world_size() == 1:  # with more ranks the logits are a gather, left out of the graphs
            head = DecodeHead(self.model.compute_logits, self.model_config.vocab_size, self.sampler,
                              self.extras.grammar.device_table if self.extras.grammar is not None else None)
        return StepGraphs(self._run_model, self.model.attention_layers(), self.backend, self.buffers,
                          self.model_config.hidden_size, self.dtype, decode_buckets, prefill_buckets, head)

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            model=self.config.model, rank=self.config.rank, world_size=self.config.tensor_parallel_size,
            dtype=str(self.dtype).removeprefix("torch."), kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            block_size=self.config.block_size,
            max_kv_blocks=self.max_kv_blocks, vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len, eos_token_ids=self.model_config.eos_token_ids,
            attention_backend=self.backend.name, device=str(self.device), platform=self.platform,
            max_num_seqs=self.config.max_num_seqs, max_num_batched_tokens=self.config.max_num_batched_tokens,
            model_fingerprint=self.fingerprint, sampling_defaults=self._sampling_defaults(), step_format=STEP_FORMAT,
            weight_dtype=self._weight_dtype(), quantization=self._quantization_name(), kv_sizing=self.kv_sizing)

    def _sampling_defaults(self) -> worker_pb2.SamplingDefaults:
        """generation_config.json's values, the ones it sets (unset fields stay unset on the wire)."""
        values = asdict(self.model_config.sampling_defaults)
        return worker_pb2.SamplingDefaults(**{name: value for name, value in values.items() if value is not None})

    @torch.inference_mode()
    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocates the cache and, on CUDA, captures the step graphs over it (every shape a
        step can take is compiled and captured here, none while serving); any sequence state
        refers to the old cache and is dropped."""
        if not 0 < num_blocks <= self.max_kv_blocks:
            raise ValueError(f"cannot allocate {num_blocks} KV blocks: this rank holds 1 to {self.max_kv_blocks}")
        self.graphs = None
        self._bind_device()
        self._allocate(num_blocks)
        started, reserved = time.perf_counter(), self._reserved_bytes()
        self.graphs = self._capture_graphs(batch_buckets(self.config.max_num_seqs),
                                           token_buckets(min(self.config.max_num_batched_tokens, PREFILL_GRAPH_MAX_TOKENS)))
        if self.graphs is not None:
            log.info("rank %d: captured %d decode and %d prefill buckets in %.1fs; they hold %.2f GiB",
                     self.config.rank, len(self.graphs.decode.buckets), len(self.graphs.prefill.buckets),
                     time.perf_counter() - started, (self._reserved_bytes() - reserved) / 2**30)
        self.phases.end("graphs")
        if self.device.type == "cuda":
            if not self._kv_profiled:  # the profiling forward warmed the sampler up; nothing else did
                self._warm_up_sampling()
            self._first_steps(num_blocks)
            warn_on_compiles(log)
        self.phases.end("first steps")

    def _first_steps(self, num_blocks: int) -> None:
        """The longest prefill a step can hold, then a two-token prefill, a mixed step (its decode
        beside another two-token prefill) and a decode, through the serving path before any request
        comes, so that the kernels outside the graphs (attention between prefill pieces, sampling)
        compile now, in every variant a step's shape picks (a long prompt's attention tiles among
        them); their K/V land in the first blocks, which hold nothing yet."""
        size = self.config.block_size
        blocks = cdiv(4, size)
        if 2 * blocks > num_blocks:
            return
        sampling = llm_pb2.SamplingParams(temperature=1.0)

        def prefill(seq_id: int, num_tokens: int = 2) -> StepEntry:
            first = seq_id * blocks
            return StepEntry(seq_id, [0] * num_tokens, sample=True, reset=True, sampling=sampling,
                             new_block_ids=range(first, first + cdiv(num_tokens, size)))

        def decode(seq_id: int, num_computed: int) -> StepEntry:
            return StepEntry(seq_id, num_computed=num_computed, sample=True, num_generated=num_computed - 1)

        longest = min(self.config.max_num_batched_tokens, self.max_model_len - 1, num_blocks * size)
        self.step(pack_step(0, [prefill(0, longest)]))
        self.step(pack_step(0, [], forget_seq_ids=[0]))
        self.step(pack_step(0, [prefill(0)]))
        if self.config.max_num_seqs == 1:  # no step can mix: one decode is all there is
            self.step(pack_step(0, [decode(0, 2)]))
        else:
            self.step(pack_step(0, [decode(0, 2), prefill(1)]))
            self.step(pack_step(0, [decode(0, 3), decode(1, 2)]))
        self.step(pack_step(0, [], forget_seq_ids=[0, 1]))

    def _reserved_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0

    def _release_kv_cache(self) -> None:
        self.kv_cache = self.kv_scales = self.seqs = self.extras = None
        for layer in self.model.attention_layers():  # their views would keep the old cache alive
            layer.bind_kv_cache(torch.empty(0), torch.empty(0))

    def _allocate(self, num_blocks: int) -> None:
        self._release_kv_cache()  # before taking memory for the new one
        layers = self.model.attention_layers()
        shape = (2, len(layers), num_blocks, self.config.block_size, layers[0].num_kv_heads, layers[0].head_dim)
        self.kv_cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        if is_quantized(self.kv_dtype):  # a float32 scale per (token, KV head), head-major in each block
            self.kv_scales = torch.empty(*shape[:2], *scales_shape(*shape[2:5]), dtype=torch.float32,
                                         device=self.device)
        for i, layer in enumerate(layers):
            scales = () if self.kv_scales is None else (self.kv_scales[0, i], self.kv_scales[1, i])
            layer.bind_kv_cache(self.kv_cache[0, i], self.kv_cache[1, i], *scales)
        self.seqs = SequenceTable(self.config.max_num_seqs, num_blocks, self.config.block_size,
                                  self.model_config.vocab_size, self.max_model_len)
        samples = tp_rank() == 0
        self.extras = SamplingExtras(self.config.max_num_seqs, self.model_config.vocab_size,
                                     tuple(self.model_config.eos_token_ids), self.device, samples,
                                     GrammarMasks(self.config.max_num_seqs, self.grammar_tokenizer, self.device)
                                     if samples else None)
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
        if inputs is not None and work.sampled:
            if logits is not None:
                processed, masks = self.extras.process(logits, work, inputs.sampled_slots)
                tokens = self._draw(processed, inputs.sampling, masks)
            else:
                tokens = torch.empty(len(work.sampled), dtype=torch.int64, device=self.device)
            broadcast_from_first_rank(tokens)
            self.last_tokens[inputs.sampled_slots] = tokens
        logprobs = self.extras.finish(logits, tokens, inputs and inputs.sampled_slots) if work else None
        step = LaunchedStep(self.clock, start, tokens if logits is not None else None, host_started, logprobs)
        if step.tokens is not None:
            step.on_home = self.extras.tokens_home(*step.tokens_home())
        return step

    def step(self, request: worker_pb2.StepRequest) -> list[int]:
        """launch() and wait: the step's sampled tokens."""
        return list(self.launch(request).reply(request.step_id).token_ids)

    @torch.inference_mode()
    def step_logits(self, request: worker_pb2.StepRequest) -> torch.Tensor | None:
        """Runs the step like step() but returns the logits [sampled entries, vocab] instead: a tensor of its
        own (a small decode's logits are a graph's static buffer, which the next step overwrites)."""
        self._bind_device()
        logits = self._compute(self._apply(request))[0]
        return None if logits is None else logits.clone()

    def _apply(self, request: worker_pb2.StepRequest) -> StepWork | None:
        """Validates the step and updates the sequence table (host only); ValueError if refused."""
        if self.seqs is None:
            raise ValueError("step before the KV cache was allocated")
        counts = request.num_token_ids[:]
        num_tokens = num_rows(counts)
        if len(counts) > self.config.max_num_seqs or num_tokens > self.config.max_num_batched_tokens:
            raise ValueError(f"step of {len(counts)} sequences and {num_tokens} tokens exceeds this "
                             f"worker's limits ({self.config.max_num_seqs} sequences, "
                             f"{self.config.max_num_batched_tokens} tokens)")
        work = self.seqs.apply(request)
        if work is not None and work.resets:
            self.extras.reset(work)
        return work

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch, masks: TokenMasks | None) -> torch.Tensor:
        """The sampled tokens: replayed where the step's graph computed the logits (StepGraphs), else drawn."""
        tokens = self.graphs.decode.draw(logits, batch, masks) if self.graphs is not None else None
        return tokens if tokens is not None else self.sampler(logits, batch, masks)

    def _compute(self, work: StepWork | None) -> tuple[torch.Tensor | None, StepInputs | None]:
        """Queues the forward pass; the logits of the sampled rows on rank 0."""
        if work is None:
            return None, None
        num_rows = self.graphs.num_rows(work) if self.graphs is not None else None
        own_rows = len(work.slots) if work.is_decode else len(work.token_ids)
        inputs = build_step_inputs(work, self.seqs, self.backend, self.last_tokens, self.buffers, self.sampler,
                                   num_rows or own_rows)
        if num_rows is not None:
            hidden = self.graphs.replay(work, num_rows, inputs.context)
        else:
            with step_context(inputs.context):
                hidden = self._run_model(inputs.input_ids, inputs.positions)
        if work.scored:  # prompt_logprobs; on every rank (a collective with tensor parallelism)
            self.extras.score_prompts(work, hidden, self.model.compute_logits)
        if not work.sampled:
            return None, inputs
        if num_rows is not None and work.is_decode and isinstance(inputs.sample_indices, slice):
            logits = self.graphs.decode.logits_of(len(work.slots))  # every row sampled, in order
            if logits is not None:
                return logits, inputs
        return self.model.compute_logits(hidden[inputs.sample_indices]), inputs

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The forward pass under the current step context (the seam for CUDA-graph replay)."""
        return self.model(input_ids, positions)
