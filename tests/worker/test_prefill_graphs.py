"""Prefill steps as the piecewise graphs run them, on CPU: the step padded to its token bucket, each
attention layer cut out of the forward pass and run over the step's real tokens between the
pieces, through the static buffers. The capture and replay themselves need CUDA (tests/gpu)."""
import pytest
import torch

from nanoserve_model.step_context import step_context
from tests.worker.worker_steps import StepWriter, cpu_runner
from worker_svc.prefill_graphs import AttentionBuffers, token_buckets
from worker_svc.step_inputs import build_step_inputs

BLOCK_SIZE = 4
PROMPT = [9707, 11, 847, 829, 374, 220, 16, 17, 5, 6]


def test_token_buckets_pad_by_less_than_half_and_end_at_the_limit():
    buckets = token_buckets(16384)
    assert buckets[:9] == [16, 32, 64, 128, 256, 384, 512, 768, 1024] and buckets[-3:] == [8192, 12288, 16384]
    assert all(b < c <= 2 * b for b, c in zip(buckets, buckets[1:]))
    assert all(c <= 1.5 * b for b, c in zip(buckets[5:], buckets[6:]))
    assert token_buckets(1000)[-3:] == [512, 768, 1000] and token_buckets(10) == [10]


@pytest.mark.parametrize("queries_in_buffer", [True, False])
def test_a_padded_step_with_attention_between_pieces_gives_the_eager_logits(tiny_model_dir, queries_in_buffer):
    """A step mixing a decode, a first prefill and a chunk (13 tokens) padded to 32 rows whose padding
    carries slot -1, stale token ids and positions, and NaN attention outputs: the live rows' logits
    are the eager step's, and so are the next step's (which read the K/V this one stored). As captured,
    each layer's rotary writes its queries into the cut's buffer (StepContext.attention_queries); a
    layer that makes them elsewhere has the cut copy them in."""
    def steps(writer: StepWriter, first: list[int]) -> tuple:
        mixed = writer.request(writer.entry(1, first, 8), writer.entry(2, PROMPT[:5], reset=True),
                               writer.entry(3, PROMPT[2:9], 2, sample=False))
        return mixed, writer.request(writer.entry(1, [5], 9, num_generated=2), writer.entry(2, [6], 5),
                                     writer.entry(3, [7], 9))

    def start(runner) -> tuple:
        writer = StepWriter(BLOCK_SIZE)
        first = runner.step(writer.request(writer.entry(1, PROMPT[:8], reset=True),
                                           writer.entry(3, PROMPT[:2], reset=True, sample=False)))
        return steps(writer, first[:1])

    plain = cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=64)
    expected = [plain.step_logits(step) for step in start(plain)]

    runner = cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=64)
    mixed, following = start(runner)
    buffers, rows = runner.buffers, 32
    device = buffers.on_device
    device.input_ids[:rows] = torch.arange(100, 100 + rows)  # stale rows of earlier steps
    device.positions[:rows] = torch.arange(rows).flip(0)
    inputs = build_step_inputs(runner.seqs.apply(mixed), runner.seqs, runner.backend, runner.last_tokens, buffers,
                               runner.sampler, num_rows=rows)
    num_tokens = len(inputs.input_ids)
    assert num_tokens == 13 and device.slot_mapping[num_tokens:rows].tolist() == [-1] * (rows - num_tokens)
    attention = AttentionBuffers(rows, runner.model.attention_layers()[0], runner.dtype, torch.device("cpu"))
    attention.out.fill_(float("nan"))

    def cut(layer, q):  # what a replay does at this point: the piece ends, attention runs, the next begins
        assert (q.data_ptr() == attention.q.data_ptr()) == queries_in_buffer
        out = attention.stage(layer, q)
        attention.attend(layer, inputs.context, num_tokens)
        return out

    context = buffers.prefill_graph_context(runner.backend, rows)
    context.attention_cut = cut
    context.attention_queries = attention.q if queries_in_buffer else None
    with torch.inference_mode(), step_context(context):
        hidden = runner.model(device.input_ids[:rows], device.positions[:rows])
        logits = runner.model.compute_logits(hidden[:num_tokens][inputs.sample_indices])
    assert hidden[num_tokens:].isnan().all() and not hidden[:num_tokens].isnan().any()
    torch.testing.assert_close(logits, expected[0])
    torch.testing.assert_close(runner.step_logits(following), expected[1])
