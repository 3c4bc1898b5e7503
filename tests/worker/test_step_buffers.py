"""The worker's step buffers: a step's inputs land in the device buffers that eager steps and CUDA
graphs share, with the host-known lengths in the attention context and graph padding rows that
the kernels skip."""
import dataclasses

import torch

from nanoserve_kernels import reference
from nanoserve_model.step_context import step_context
from tests.worker.worker_steps import StepWriter, cpu_runner
from worker_svc.step_buffers import StepBuffers
from worker_svc.step_inputs import build_step_inputs

BLOCK_SIZE = 4
PROMPT = [9707, 11, 847, 829, 374, 220, 16, 17, 5, 6]


def padded_table(blocks: list[int], width: int) -> list[int]:
    return blocks + [-1] * (width - len(blocks))


def test_prefill_context_carries_the_lengths_the_host_knows(tiny_model_dir):
    """A step mixing a decode, a first prefill and a chunk: every layer's prefill call gets the
    step's cumulative key lengths and its longest query and context as plain ints."""
    runner = cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=64)
    calls = []

    def recording_prefill(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          block_tables, scale, out=None):
        calls.append((cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), max_seqlen_q, max_seqlen_k,
                      block_tables.tolist()))
        return reference.paged_prefill(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, block_tables, scale, out=out)

    runner.backend = dataclasses.replace(runner.backend, paged_prefill=recording_prefill)
    writer = StepWriter(BLOCK_SIZE)
    first = runner.step(writer.request(writer.entry(1, PROMPT[:8], reset=True), writer.entry(3, PROMPT[:2], reset=True,
                                                                                             sample=False)))
    calls.clear()
    runner.step(writer.request(writer.entry(1, first, 8), writer.entry(2, PROMPT[:5], reset=True),
                               writer.entry(3, PROMPT[2:9], 2, sample=False)))
    # new tokens 1, 5, 7; contexts 9, 5, 9; tables of 3, 2 and 3 blocks
    expected = ([0, 1, 6, 13], [0, 9, 14, 23], 7, 9, [padded_table(writer.tables[i], 3) for i in (1, 2, 3)])
    assert calls == [expected] * runner.model_config.num_hidden_layers


def test_decode_rows_past_the_batch_are_padding_that_disturbs_nothing(tiny_model_dir):
    """A decode of 3 sequences staged for a graph bucket of 8 rows, then run over all 8 rows as a
    replay would: rows 3..7 carry slot -1 and context length 0, the 3 live rows give the logits of
    an unpadded step, and the next step (whose attention reads the cache) is unchanged too."""
    runner, writer = cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=64), StepWriter(BLOCK_SIZE)
    prompts = {1: PROMPT, 2: PROMPT[:3], 3: PROMPT[4:9]}
    first = runner.step(writer.request(*(writer.entry(i, p, reset=True) for i, p in prompts.items())))
    plain = cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=64)  # the same steps, never padded
    plain.step(writer.request(*(writer.entry(i, p, reset=True, shared_blocks=tuple(writer.tables[i]))
                                for i, p in prompts.items())))
    decode = writer.request(*(writer.entry(i, [t], len(p), num_generated=1)
                              for (i, p), t in zip(prompts.items(), first)))
    following = writer.request(*(writer.entry(i, [7], len(p) + 1, num_generated=2) for i, p in prompts.items()))
    expected = [plain.step_logits(decode), plain.step_logits(following)]

    buffers = runner.buffers
    inputs = build_step_inputs(runner.seqs.apply(decode), runner.seqs, runner.backend, runner.last_tokens, buffers,
                               runner.sampler, num_rows=8)
    device = buffers.on_device
    assert device.slot_mapping[3:8].tolist() == [-1] * 5 and device.context_lens[3:8].tolist() == [0] * 5
    assert device.context_lens[:3].tolist() == [len(p) + 1 for p in prompts.values()]
    assert inputs.context.block_tables.data_ptr() == device.block_tables.data_ptr()  # views, no copies
    assert inputs.context.block_tables.shape == (3, buffers.max_blocks_per_seq)
    with torch.inference_mode(), step_context(buffers.decode_context(runner.backend, 8)):
        hidden = runner.model(device.input_ids[:8], device.positions[:8])
        logits = runner.model.compute_logits(hidden[:3])
    torch.testing.assert_close(logits, expected[0])
    torch.testing.assert_close(runner.step_logits(following), expected[1])


def test_on_cpu_the_device_buffers_are_the_staging_set():
    """CPU work is done when its launch returns, so there is nothing to copy and no ring
    (tests/gpu checks the pinned ring on CUDA)."""
    buffers = StepBuffers(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, block_size=BLOCK_SIZE,
                          device=torch.device("cpu"))
    staging = buffers.next_staging()
    assert staging.tensors is buffers.on_device and buffers.next_staging() is staging
    staging.arrays.input_ids[:3] = [5, 6, 7]
    assert buffers.on_device.input_ids[:3].tolist() == [5, 6, 7]
