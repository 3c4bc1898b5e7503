"""Qwen3-MoE on the paged KV cache (float32, CPU: the plain per-expert path) against transformers'
Qwen3MoeForCausalLM on the same tiny checkpoints (moe_models.VARIANTS: top-2 renormalised, top-8 of
16 without renormalising and a dense first layer, experts in every second layer): logits of batched
prefill and of decode steps beside a chunked prefill in each; a prefix-cache hit and greedy generations
in the top-2 one (the services' tests generate with the top-8 one). Every token the tests run clears
the router margin (moe_models.moe_model)."""
import pytest
import torch

from tests.worker.moe_models import MARGIN, VARIANTS, hf_greedy, hf_model, moe_model, router_margin
from tests.worker.test_families_vs_hf import assert_decodes_beside_chunked_prefill
from tests.worker.test_model_vs_hf import assert_close, hf_logits, random_prompt
from tests.worker.worker_steps import StepWriter, cpu_runner, generate

BLOCK_SIZE = 4
PREFILL = [random_prompt(n, seed) for seed, n in enumerate([5, 12, 1, 17, 30])]
SHORT, LONG = random_prompt(6, 10), random_prompt(23, 11)
DECODE_STEPS = 20  # assert_decodes_beside_chunked_prefill's
FIRST = random_prompt(14, 20)
SECOND = FIRST[:12] + random_prompt(5, 21)  # shares FIRST's 3 full blocks
GREEDY = {i: random_prompt(n, 40 + i) for i, n in enumerate([4, 9, 15])}
GREEDY_TOKENS = 16


def logit_sequences(hf) -> dict[str, list[int]]:
    """The sequences whose logits every variant compares, transformers' greedy continuation included."""
    return {**{f"prefill{i}": p for i, p in enumerate(PREFILL)},
            "decode": SHORT + hf_greedy(hf, SHORT, DECODE_STEPS + 1), "long": LONG}


def sequences(hf) -> dict[str, list[int]]:
    """Every sequence these tests run through the top-2 variant."""
    return {**logit_sequences(hf), "first": FIRST, "second": SECOND,
            **{f"greedy{i}": p + hf_greedy(hf, p, GREEDY_TOKENS) for i, p in GREEDY.items()}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request) -> tuple:
    return moe_model(request.param, logit_sequences)


@pytest.fixture(scope="module")
def top2() -> tuple:
    return moe_model("top2", sequences)


def test_the_oracle_routes_as_the_variant_says(variant):
    path, hf, run = variant
    config = hf.config
    sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and any(sparse)
    assert sparse == [i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0
                      for i in range(config.num_hidden_layers)]


def test_batched_prefill_matches_transformers(variant):
    path, hf, run = variant
    writer = StepWriter(BLOCK_SIZE)
    logits = cpu_runner(path, BLOCK_SIZE).step_logits(
        writer.request(*(writer.entry(i, p, reset=True) for i, p in enumerate(PREFILL))))
    for row, prompt in zip(logits, PREFILL):
        assert_close(row, hf_logits(hf, prompt)[-1])


def test_decode_steps_and_chunked_prefill_match_transformers(variant):
    path, hf, run = variant
    assert_decodes_beside_chunked_prefill(path, run["decode"], len(SHORT), LONG, hf_logits(hf, run["decode"]),
                                          hf_logits(hf, LONG)[-1])


def test_prefix_cached_prompt_computes_only_its_suffix(top2):
    """The second prompt reuses the first's 3 full blocks and computes its last 5 tokens."""
    path, hf, run = top2
    runner, writer = cpu_runner(path, BLOCK_SIZE), StepWriter(BLOCK_SIZE)
    runner.step(writer.request(writer.entry(1, FIRST, reset=True)))
    shared = tuple(writer.tables[1][:3])
    logits = runner.step_logits(writer.request(writer.entry(2, SECOND[12:], 12, reset=True, shared_blocks=shared)))
    assert_close(logits[0], hf_logits(hf, SECOND)[-1])


def test_greedy_generation_equals_transformers_generate(top2):
    path, hf, run = top2
    ours = generate(cpu_runner(path, BLOCK_SIZE), StepWriter(BLOCK_SIZE), GREEDY, GREEDY_TOKENS)
    for seq_id, prompt in GREEDY.items():
        expected = run[f"greedy{seq_id}"][len(prompt):]
        assert ours[seq_id] == expected
        assert len(set(expected)) > 8  # the tiny model wanders; a stuck model would prove little


def test_moe_layers_hold_every_expert_stacked(variant):
    path, hf, run = variant
    ours = cpu_runner(path, BLOCK_SIZE).model
    for i, layer in enumerate(hf.model.layers):
        if type(layer.mlp).__name__ != "Qwen3MoeSparseMoeBlock":
            assert hasattr(ours.model.layers[i].mlp, "gate_up_proj")
            continue
        experts = ours.model.layers[i].mlp.experts
        assert torch.equal(experts.gate_up_proj, layer.mlp.experts.gate_up_proj)
        assert torch.equal(experts.down_proj, layer.mlp.experts.down_proj)


def test_online_fp8_quantizes_attention_and_the_experts_and_keeps_the_routers(top2):
    """--quantization fp8 (dequantized at load on CPU) quantizes q/k/v, o and every expert and leaves the
    routers as they are: the logits are transformers' once it holds the same dequantized weights (the
    routers still clear the margin on the prompt)."""
    path, _, run = top2
    runner, writer = cpu_runner(path, BLOCK_SIZE, quantization="fp8"), StepWriter(BLOCK_SIZE)
    logits = runner.step_logits(writer.request(writer.entry(0, PREFILL[4], reset=True)))
    hf = hf_model(path)
    with torch.no_grad():
        for ours, theirs in zip(runner.model.model.layers, hf.model.layers):
            attention = theirs.self_attn
            q, k, v = ours.self_attn.qkv_proj.weight.split([attention.q_proj.weight.shape[0],
                                                            attention.k_proj.weight.shape[0],
                                                            attention.v_proj.weight.shape[0]])
            assert not torch.equal(q, attention.q_proj.weight)  # quantized
            assert not torch.equal(ours.mlp.experts.down_proj, theirs.mlp.experts.down_proj)
            for weight, into in ((q, attention.q_proj.weight), (k, attention.k_proj.weight),
                                 (v, attention.v_proj.weight), (ours.self_attn.o_proj.weight, attention.o_proj.weight),
                                 (ours.mlp.experts.gate_up_proj, theirs.mlp.experts.gate_up_proj),
                                 (ours.mlp.experts.down_proj, theirs.mlp.experts.down_proj)):
                into.copy_(weight)
            assert torch.equal(ours.mlp.gate.weight, theirs.mlp.gate.weight)
    assert router_margin(hf, PREFILL[4]) > MARGIN
    assert_close(logits[0], hf_logits(hf, PREFILL[4])[-1])
