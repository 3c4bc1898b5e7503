"""The worker on a GPU against transformers: our kernels and CUDA graphs must not change the model.

Runs only where CUDA is present (the lent H100/H200), from the repo root:
    PYTHONPATH=.:proto python3 -m pytest tests/gpu -q
"""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoserve.step_rows import StepEntry
from nanoserve_kernels import flash_attn_backend
from nanoserve_kernels.pdl import pdl_on
from nanoserve_kernels.token_bitmask import TokenMasks, bitmask_words
from nanoserve_model import row_fusion
from nanoserve_model.sampler import Sampler, SamplingBatch, SamplingRow
from nanoserve_cli.demo_model import SHAPE, config_json, random_weights, write_checkpoint
from tests.worker.worker_steps import StepWriter, generate
from worker_svc.config import WorkerConfig
from worker_svc.draw_graphs import DrawGraphs
from worker_svc.launched_step import MAX_STEPS_IN_FLIGHT
from worker_svc.runner import ModelRunner
from worker_svc.step_buffers import StepBuffers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# head_dim 128 so that the minimal flash-attn build serves it too
SHAPE_128 = {**SHAPE, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128}
BACKENDS = ["triton"] + (["flash-attn"] if flash_attn_backend.AVAILABLE else [])
# (backend, KV cache dtype): flash-attn cannot read an FP8 cache
GRAPH_CASES = [(backend, "auto") for backend in BACKENDS] + [("triton", "fp8")]


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("bf16"), config_json(False, SHAPE_128, "bfloat16"),
                            random_weights(False, SHAPE_128, 0.05, torch.bfloat16))


def gpu_runner(model_dir, backend: str, eager: bool, dtype: str, num_blocks: int = 64,
               kv_cache_dtype: str = "auto") -> ModelRunner:
    block_size = 256 if backend == "flash-attn" else 16
    runner = ModelRunner(WorkerConfig(model=str(model_dir), device="cuda", dtype=dtype, block_size=block_size,
                                      num_kv_blocks=num_blocks, max_num_seqs=32, attention_backend=backend,
                                      enforce_eager=eager, max_model_len=2048, kv_cache_dtype=kv_cache_dtype))
    runner.allocate_kv_cache(num_blocks)
    return runner


def prompts(count: int, seed: int = 0) -> dict[int, list[int]]:
    rng = random.Random(seed)
    return {i: [rng.randrange(151_643) for _ in range(rng.randrange(5, 200))] for i in range(count)}


def hf_greedy(model_dir, prompt: list[int], n: int, dtype: torch.dtype) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_greedy_fp32_matches_transformers(tiny_model_dir, eager):
    runner = gpu_runner(tiny_model_dir, "triton", eager, "float32")
    batch = prompts(4)
    ours = generate(runner, StepWriter(runner.config.block_size), batch, 16)
    for seq_id, prompt in batch.items():
        assert ours[seq_id] == hf_greedy(tiny_model_dir, prompt, 16, torch.float32)


def assert_teacher_forced_logits_close(model_dir, backend: str) -> None:
    """Prefill then 20 decode steps (replayed from graphs) fed transformers' own next tokens: every
    step's bf16 logits within 2% (relative norm) of transformers' float32 ones."""
    runner = gpu_runner(model_dir, backend, False, "bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    batch = prompts(3, seed=1)
    full = {i: p + [random.Random(i).randrange(151_643) for _ in range(20)] for i, p in batch.items()}
    writer = StepWriter(runner.config.block_size)
    steps = [runner.step_logits(writer.request(*(writer.entry(i, p, reset=True) for i, p in batch.items())))]
    for t in range(20):
        steps.append(runner.step_logits(writer.request(*(
            writer.entry(i, [full[i][len(p) + t]], len(p) + t, num_generated=t + 1) for i, p in batch.items()))))
    with torch.no_grad():
        for row, (i, p) in enumerate(batch.items()):
            ref = hf(torch.tensor([full[i]], device="cuda")).logits[0, len(p) - 1:len(p) + 20].float()
            ours = torch.stack([s[row].float() for s in steps])
            error = ((ours - ref).norm() / ref.norm()).item()
            assert error < 2e-2, f"sequence {i}: relative error {error:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_forced_bf16_logits_close_to_transformers(bf16_model_dir, backend):
    assert_teacher_forced_logits_close(bf16_model_dir, backend)


@pytest.mark.parametrize("backend, kv_cache_dtype", GRAPH_CASES)
@pytest.mark.parametrize("batch_size", [1, 3, 16])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_cuda_graph_decode_gives_the_eager_tokens(bf16_model_dir, backend, kv_cache_dtype, batch_size, temperature):
    """One runner, so weights and compiled kernels are shared: decode by graph replay (the logits and the draw
    in the graphs too: the argmax greedy, the race seeded), then the same steps eagerly (batch 1 through the
    gemvs with the norm fused in; batch 3 pads to the bucket of 4)."""
    runner = gpu_runner(bf16_model_dir, backend, False, "bfloat16", num_blocks=256 if backend == "triton" else 64,
                        kv_cache_dtype=kv_cache_dtype)
    batch = prompts(batch_size, seed=2)
    sampling = {seq_id: dict(temperature=temperature, seed=100 + seq_id) for seq_id in batch}
    replayed = generate(runner, StepWriter(runner.config.block_size), batch, 32, sampling)
    graphs, runner.graphs = runner.graphs, None
    eager = generate(runner, StepWriter(runner.config.block_size), batch, 32, sampling)
    assert graphs is not None and graphs.decode.draws is not None and replayed == eager


@pytest.mark.parametrize("num_rows", [1, 3, 4, 7])
def test_draw_graphs_give_the_sampler_draws(num_rows):
    """Each kind of replayed draw against the sampler's own launches on the same static buffers: the argmax,
    the race at mixed temperatures (greedy rows among them), the race under grammar masks read by slot (each
    row allowing about one token in 8); rows past num_rows pad the bucket (3 -> 4, 7 -> 8); masks uploaded
    for a step (some rows constrained) are not a graph's."""
    device, vocab, capacity = torch.device("cuda"), 151_936, 16
    sampler, generator = Sampler(device, 7), torch.Generator(device).manual_seed(0)
    logits = torch.randn(8, vocab, device=device, generator=generator).to(torch.bfloat16)
    columns = sampler.batch([SamplingRow(0.0 if row % 3 == 0 else 0.7, row, 5) for row in range(8)])
    slots = torch.randperm(capacity, device=device, generator=generator)[:8]
    def bits() -> torch.Tensor:
        return torch.randint(0, 2**31 - 1, (capacity, bitmask_words(vocab)), dtype=torch.int32, device=device,
                             generator=generator)
    table = bits() & bits() & bits()  # each token allowed with odds 1 in 8
    draws = DrawGraphs(sampler, logits, columns, slots, table, [1, 2, 4, 8], torch.cuda.graph_pool_handle(),
                       torch.cuda.Stream())
    bucket = 1 << (num_rows - 1).bit_length()
    rows = SamplingBatch(*(column[:num_rows] for column in columns[:3]), all_greedy=False)
    greedy = rows._replace(all_greedy=True)
    for batch, masks in ((greedy, None), (rows, None), (rows, TokenMasks(table, slots[:num_rows]))):
        expected = sampler(logits[:num_rows], batch, masks)
        assert torch.equal(draws.replay(num_rows, bucket, batch, masks), expected)
    other_rows = TokenMasks(table, slots[:num_rows].clone())  # some rows' masks, uploaded for the step: eager
    assert draws.replay(num_rows, bucket, rows, other_rows) is None


def test_batch1_decode_row_fusions_keep_the_logits(bf16_model_dir, monkeypatch):
    """Batch-1 greedy decode (eager, so the switch holds for every step) with the norms and the
    SiLU-and-mul fused into the projections and without: the same tokens and logits within 1e-2 (the
    norm's float32 sum over the row may round its last bit otherwise, which may flip the rounding of
    an element of x)."""
    runner = gpu_runner(bf16_model_dir, "triton", True, "bfloat16")
    prompt = prompts(1, seed=6)[0]

    def decode() -> tuple[list[int], torch.Tensor]:
        writer = StepWriter(runner.config.block_size)
        logits, tokens = [runner.step_logits(writer.request(writer.entry(0, prompt, reset=True)))], []
        for t in range(24):
            tokens.append(int(logits[-1].argmax()))
            logits.append(runner.step_logits(writer.request(
                writer.entry(0, tokens[-1:], len(prompt) + t, num_generated=t + 1))))
        runner.step(writer.request(forget=(0,)))
        return tokens, torch.cat(logits[1:]).float()  # the decode steps' (the prefill has many rows)

    monkeypatch.setattr(row_fusion, "FUSED", {"rms_norm", "silu_mul"})
    tokens, logits = decode()
    monkeypatch.setattr(row_fusion, "FUSED", set())
    separate_tokens, separate_logits = decode()
    assert tokens == separate_tokens
    assert ((logits - separate_logits).norm() / separate_logits.norm()).item() < 1e-2


def test_batch_decode_gate_up_fusion_keeps_the_logits(bf16_model_dir, monkeypatch):
    """Greedy decode of 8 sequences (eager, so the switch holds for every step) with the SiLU-and-mul
    in the gate/up GEMM's epilogue and with cuBLAS then the SiLU-and-mul kernel: the same tokens and
    logits within 1e-2 (the two GEMMs' float32 sums may round an element of gate or up apart)."""
    from nanoserve_kernels.triton_gate_up import takes
    runner = gpu_runner(bf16_model_dir, "triton", True, "bfloat16")
    batch = prompts(8, seed=7)
    gate_up = runner.model.model.layers[0].mlp.gate_up_proj.weight
    assert takes(torch.empty(len(batch), gate_up.shape[1], dtype=gate_up.dtype, device="cuda"), gate_up)

    def decode() -> tuple[dict[int, list[int]], torch.Tensor]:
        writer = StepWriter(runner.config.block_size)
        logits = [runner.step_logits(writer.request(*(writer.entry(i, p, reset=True) for i, p in batch.items())))]
        tokens: dict[int, list[int]] = {i: [] for i in batch}
        for t in range(16):
            for row, i in enumerate(batch):
                tokens[i].append(int(logits[-1][row].argmax()))
            logits.append(runner.step_logits(writer.request(*(
                writer.entry(i, tokens[i][-1:], len(p) + t, num_generated=t + 1) for i, p in batch.items()))))
        runner.step(writer.request(forget=tuple(batch)))
        return tokens, torch.cat(logits[1:]).float()

    tokens, logits = decode()
    monkeypatch.setattr(row_fusion, "FUSED", row_fusion.FUSED - {"gate_up_silu"})
    separate_tokens, separate_logits = decode()
    assert tokens == separate_tokens
    assert ((logits - separate_logits).norm() / separate_logits.norm()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs Hopper or later")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_dependent_launches_give_the_logits_of_plain_ones(bf16_model_dir, monkeypatch, kv_cache_dtype):
    """Decode through CUDA graphs whose kernels launch with PDL (each may start while the one before
    it runs) and with plain launches: bit-identical logits at batch 1 (the gemv chain) and the
    same tokens at batch 5. A kernel that touched shared memory before its wait would race."""
    def decode(pdl: bool) -> tuple[torch.Tensor, dict]:
        monkeypatch.setenv("NANOSERVE_PDL", "1" if pdl else "0")
        pdl_on.cache_clear()
        runner = gpu_runner(bf16_model_dir, "triton", False, "bfloat16", num_blocks=256,
                            kv_cache_dtype=kv_cache_dtype)
        assert pdl_on(runner.device) == pdl and runner.graphs is not None
        writer, prompt = StepWriter(runner.config.block_size), prompts(1, seed=7)[0]
        logits = [runner.step_logits(writer.request(writer.entry(0, prompt, reset=True)))]
        for t in range(32):
            token = int(logits[-1][-1].argmax())
            logits.append(runner.step_logits(writer.request(
                writer.entry(0, [token], len(prompt) + t, num_generated=t + 1))))
        runner.step(writer.request(forget=(0,)))
        tokens = generate(runner, StepWriter(runner.config.block_size), prompts(5, seed=8), 24, pipelined=True)
        return torch.cat(logits[1:]), tokens

    plain_logits, plain_tokens = decode(False)
    dependent_logits, dependent_tokens = decode(True)
    pdl_on.cache_clear()
    assert torch.equal(plain_logits, dependent_logits)
    assert plain_tokens == dependent_tokens


@pytest.mark.parametrize("backend, kv_cache_dtype", GRAPH_CASES)
def test_prefill_graphs_give_the_eager_logits_and_tokens(bf16_model_dir, backend, kv_cache_dtype):
    """Prefill steps replayed piecewise (padded to their token bucket, attention between the pieces)
    against the same steps run eagerly on the same runner: a first prefill of several prompts, a
    prefix-cache hit, a step mixing decodes with a chunk that continues mid-block, then greedy
    decoding; logits close and every greedy token the same."""
    runner = gpu_runner(bf16_model_dir, backend, False, "bfloat16", num_blocks=256 if backend == "triton" else 64,
                        kv_cache_dtype=kv_cache_dtype)
    size = runner.config.block_size
    batch = prompts(5, seed=4)
    long = list(range(1000, 1000 + 3 * size + 5))
    hit_prompt, cached = batch[0] + [5, 6, 7], len(batch[0]) // size * size

    def run() -> tuple[list[torch.Tensor], dict[int, list[int]]]:
        writer = StepWriter(size)
        first = writer.request(*(writer.entry(i, p, reset=True) for i, p in batch.items()),
                               writer.entry(9, long[:size + 3], reset=True, sample=False))
        hit = writer.request(writer.entry(10, hit_prompt[cached:], cached, reset=True,
                                          shared_blocks=tuple(writer.tables[0][:cached // size])))
        mixed = writer.request(writer.entry(9, long[size + 3:], size + 3),
                               *(writer.entry(i, [17], len(p), num_generated=1) for i, p in batch.items()))
        logits = [runner.step_logits(step).float() for step in (first, hit, mixed)]
        runner.step(writer.request(forget=(9, 10, *batch)))
        return logits, generate(runner, StepWriter(size), batch, 24)

    first_tokens = sum(map(len, batch.values())) + size + 3
    assert runner.graphs is not None and runner.graphs.prefill.num_rows(first_tokens) > first_tokens
    replayed = run()
    runner.graphs = None
    eager = run()
    for ours, reference in zip(replayed[0], eager[0]):
        assert ((ours - reference).norm() / reference.norm()).item() < 1e-2
    assert replayed[1] == eager[1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_mixed_steps_leading_decodes_give_the_prefill_kernels_logits(bf16_model_dir, backend, eager):
    """A mixed step as the scheduler orders it, decodes first (they attend through the decode kernel),
    against the same entries with the decodes last (every row through the prefill kernel), eagerly
    and through the piecewise graphs: the logits agree."""
    runner = gpu_runner(bf16_model_dir, backend, eager, "bfloat16", num_blocks=256 if backend == "triton" else 64)
    size = runner.config.block_size
    batch = prompts(6, seed=7)
    long = list(range(2000, 2000 + 2 * size + 9))

    def mixed_logits(decodes_first: bool) -> torch.Tensor:
        writer = StepWriter(size)
        first = runner.step(writer.request(*(writer.entry(i, p, reset=True) for i, p in batch.items()),
                                           writer.entry(9, long[:size + 3], reset=True, sample=False)))
        decodes = [writer.entry(i, [t], len(p), num_generated=1) for (i, p), t in zip(batch.items(), first)]
        chunk = writer.entry(9, long[size + 3:], size + 3)
        logits = runner.step_logits(writer.request(*decodes, chunk) if decodes_first
                                    else writer.request(chunk, *decodes)).float()
        runner.step(writer.request(forget=(9, *batch)))
        return logits if decodes_first else torch.cat([logits[1:], logits[:1]])

    split, whole = mixed_logits(True), mixed_logits(False)
    assert split.shape == (len(batch) + 1, runner.model_config.vocab_size)
    assert ((split - whole).norm() / whole.norm()).item() < 1e-2


def test_kv_pool_sized_from_gpu_memory(tiny_model_dir):
    """No forced block count: the warm-up sizes the pool under gpu_memory_utilization."""
    runner = ModelRunner(WorkerConfig(model=str(tiny_model_dir), device="cuda", block_size=16,
                                      gpu_memory_utilization=0.5, max_model_len=2048))
    free, total = torch.cuda.mem_get_info()
    budget = runner.max_kv_blocks * runner._kv_block_bytes()
    assert 0 < budget < 0.5 * total
    assert runner.info().max_kv_blocks == runner.max_kv_blocks


def test_sized_cache_with_its_graphs_and_largest_step_stays_under_the_utilization(tiny_model_dir):
    """Sized from memory, the whole cache allocated, every graph captured over it and the largest
    prefill step run: the device holds no more than gpu_memory_utilization of its memory, give or
    take how much more the pool of every bucket takes than that of the largest ones, which the
    sizing measured (256 MiB)."""
    runner = ModelRunner(WorkerConfig(model=str(tiny_model_dir), device="cuda", block_size=16,
                                      gpu_memory_utilization=0.5, max_model_len=4096, max_num_seqs=64,
                                      max_num_batched_tokens=8192))
    runner.allocate_kv_cache(runner.max_kv_blocks)
    assert runner.graphs is not None
    writer = StepWriter(16)
    runner.step(writer.request(writer.entry(1, [7] * 4096, reset=True), writer.entry(2, [8] * 4096, reset=True)))
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    assert total - free <= 0.5 * total + 2**28


def test_host_staging_is_a_pinned_ring_one_deeper_than_the_steps_in_flight():
    buffers = StepBuffers(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, block_size=16,
                          device=torch.device("cuda"))
    depth = MAX_STEPS_IN_FLIGHT + 1
    sets = [buffers.next_staging() for _ in range(2 * depth)]
    assert len({id(s) for s in sets[:depth]}) == depth and sets[depth:] == sets[:depth]
    assert all(s.tensors.input_ids.is_pinned() and s.tensors is not buffers.on_device for s in sets)
    assert buffers.on_device.block_tables.is_cuda


def test_steps_staged_while_the_device_is_busy_keep_their_own_inputs(tiny_model_dir):
    """Twice as many steps as host staging sets, launched while the device still sleeps through
    earlier work, so their input copies are pending when later steps stage theirs: each step's
    logits must equal those of the same step run alone."""
    runner = gpu_runner(tiny_model_dir, "triton", True, "float32", num_blocks=256)
    batch = prompts(2 * (MAX_STEPS_IN_FLIGHT + 1), seed=3)

    def requests() -> list:
        writer = StepWriter(runner.config.block_size)
        return [writer.request(writer.entry(i, prompt, reset=True)) for i, prompt in batch.items()]

    alone = [runner.step_logits(request).cpu() for request in requests()]  # .cpu() waits for each
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time queued ahead of every step below
    queued = [runner.step_logits(request) for request in requests()]
    for ours, reference in zip(queued, alone):
        torch.testing.assert_close(ours.cpu(), reference)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_serving_steps_compile_no_kernel_after_start_up(bf16_model_dir, kv_cache_dtype):
    """Steps of the shapes serving produces (mixed steps with 1 to 8 leading decodes, so their
    metadata starts at every 16-byte alignment; through the piecewise graphs and eagerly past the
    largest bucket; decodes of several batch sizes) compile no Triton kernel once the cache is
    allocated: a compile while serving stalls every request for ~1 s (a mixed step's offset
    cu_seqlens once compiled two variants of the prefill kernel)."""
    import triton

    runner = ModelRunner(WorkerConfig(model=str(bf16_model_dir), device="cuda", dtype="bfloat16", block_size=256,
                                      num_kv_blocks=1024, max_num_seqs=32, attention_backend="triton",
                                      max_model_len=4096, max_num_batched_tokens=12288, kv_cache_dtype=kv_cache_dtype))
    runner.allocate_kv_cache(1024)
    compiled: list[str] = []
    triton.knobs.runtime.jit_post_compile_hook = lambda *, repr, **_: compiled.append(repr)
    try:
        writer, batch = StepWriter(runner.config.block_size), prompts(8, seed=3)
        first = runner.step(writer.request(*(writer.entry(i, p, reset=True) for i, p in batch.items())))
        tokens, lengths = dict(zip(batch, first)), {i: len(p) for i, p in batch.items()}  # lengths: in the cache

        def decode(seq_ids: list[int]) -> list[StepEntry]:
            return [writer.entry(i, [tokens[i]], lengths[i], num_generated=1) for i in seq_ids]

        def advance(seq_ids: list[int], sampled: list[int]) -> None:
            for i, token in zip(seq_ids, sampled):
                tokens[i], lengths[i] = token, lengths[i] + 1

        for num_decodes in range(1, 9):
            running = list(batch)[:num_decodes]
            # one short chunk and two longer ones (graph buckets), then three long ones (past the largest bucket: eager)
            for chunks in ([40], [1100, 1100], [3000, 3000, 3000]):
                new = [writer.entry(100 + j, list(range(n)), reset=True) for j, n in enumerate(chunks)]
                advance(running, runner.step(writer.request(*decode(running), *new)))
                runner.step(writer.request(forget=tuple(100 + j for j in range(len(chunks)))))
        for size in (1, 3, 8):
            running = list(batch)[:size]
            advance(running, runner.step(writer.request(*decode(running))))
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    assert compiled == []
