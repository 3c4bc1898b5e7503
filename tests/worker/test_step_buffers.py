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


def _recording_runner(tiny_model_dir) -> tuple:
    """A runner whose backend records each paged_prefill and paged_decode call, and the record."""
    runner = cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=64)
    calls = []

    def recording_prefill(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          block_tables, scale, out=None):
        calls.append((cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), max_seqlen_q, max_seqlen_k,
                      block_tables.tolist()))
        return reference.paged_prefill(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, block_tables, scale, out=out)

    def recording_decode(q, k_cache, v_cache, context_lens, block_tables, scale, order):
        calls.append((context_lens.tolist(), block_tables.tolist(), order.tolist()))
        return reference.paged_decode(q, k_cache, v_cache, context_lens, block_tables, scale)

    runner.backend = dataclasses.replace(runner.backend, paged_prefill=recording_prefill,
                                         paged_decode=recording_decode)
    writer = StepWriter(BLOCK_SIZE)
    first = runner.step(writer.request(writer.entry(1, PROMPT[:8], reset=True), writer.entry(3, PROMPT[:2], reset=True,
                                                                                             sample=False)))
    calls.clear()
    return runner, writer, first, calls


def test_prefill_context_carries_the_lengths_the_host_knows(tiny_model_dir):
    """A step of a first prefill, a chunk and a decode after them: every layer's prefill call gets the
    step's cumulative key lengths and its longest query and context as plain ints."""
    runner, writer, first, calls = _recording_runner(tiny_model_dir)
    runner.step(writer.request(writer.entry(2, PROMPT[:5], reset=True), writer.entry(3, PROMPT[2:9], 2, sample=False),
                               writer.entry(1, first, 8)))
    # new tokens 5, 7, 1; contexts 5, 9, 9; tables of 2, 3 and 3 blocks
    expected = ([0, 5, 12, 13], [0, 5, 14, 23], 7, 9, [padded_table(writer.tables[i], 3) for i in (2, 3, 1)])
    assert calls == [expected] * runner.model_config.num_hidden_layers


def test_a_mixed_steps_leading_decodes_attend_through_the_decode_kernel(tiny_model_dir):
    """The scheduler's order: a decode, then a first prefill and a chunk. Each layer's decode call
    gets the decode's row; its prefill call the lengths of the two others, from 0."""
    runner, writer, first, calls = _recording_runner(tiny_model_dir)
    runner.step(writer.request(writer.entry(1, first, 8), writer.entry(2, PROMPT[:5], reset=True),
                               writer.entry(3, PROMPT[2:9], 2, sample=False)))
    # the decode: context 9, a table of 3 blocks; then new tokens 5, 7; contexts 5, 9; tables of 2 and 3 blocks
    decode = ([9], [padded_table(writer.tables[1], 3)], [0])
    prefill = ([0, 5, 12], [0, 5, 14], 7, 9, [padded_table(writer.tables[i], 3) for i in (2, 3)])
    assert calls == [decode, prefill] * runner.model_config.num_hidden_layers


def test_the_decode_kernel_gets_the_decoding_rows_longest_context_first(tiny_model_dir):
    """A mixed step's leading decodes, the shorter first, and a prompt: the decode call's order puts
    the longer one's row first (the Triton kernel starts it first); the prompt takes no part in it."""
    runner, writer, first, calls = _recording_runner(tiny_model_dir)
    second = runner.step(writer.request(writer.entry(2, PROMPT[:5], reset=True)))
    calls.clear()
    runner.step(writer.request(writer.entry(2, second, 5), writer.entry(1, first, 8),
                               writer.entry(4, PROMPT[:3], reset=True)))
    decode = ([6, 9], [padded_table(writer.tables[i], 3) for i in (2, 1)], [1, 0])
    assert calls[0] == decode


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
    assert device.decode_order[:8].tolist() == [0, 2, 1, 3, 4, 5, 6, 7]  # contexts 11, 4, 6; then the padding
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


def test_a_steps_copies_carry_its_rows_and_skip_token_ids_that_are_fed_on_the_device():
    """StepTensors.copy_from between two host sets (on CUDA the pinned set and the device buffers):
    every row a step uses arrives; the token ids stay behind when every row is fed from the last
    sampled tokens, since the device gathers them there."""
    from worker_svc.step_buffers import StepTensors
    cpu = torch.device("cpu")
    staged, device = (StepTensors(16, 4, 3, cpu, pin=False) for _ in range(2))
    for name, tensor in vars(staged).items():
        if isinstance(tensor, torch.Tensor) and name not in ("indices", "lengths", "sample_temperatures"):
            tensor.copy_(torch.arange(tensor.numel()).view(tensor.shape) + 100)
    staged.sample_temperatures[:2] = torch.tensor([0.5, 1.5], dtype=torch.float64)

    device.copy_from(staged, num_tokens=3, num_slots=4, num_seqs=2, num_fed=3)
    for name, count in (("positions", 3), ("slot_mapping", 4), ("context_lens", 2), ("decode_order", 2),
                        ("cu_seqlens_q", 3),
                        ("cu_seqlens_k", 3), ("block_tables", 2), ("sample_indices", 2), ("sampled_slots", 2),
                        ("fed_rows", 2), ("fed_slots", 2), ("sample_keys", 2), ("sample_counters", 2),
                        ("sample_temperatures", 2)):
        assert torch.equal(getattr(device, name)[:count], getattr(staged, name)[:count]), name
    assert not device.input_ids.any()
    assert not device.slot_mapping[4:].any() and not device.positions[3:].any() and not device.block_tables[2:].any()

    device.copy_from(staged, num_tokens=3, num_slots=4, num_seqs=2, num_fed=1)
    assert torch.equal(device.input_ids[:3], staged.input_ids[:3]) and not device.input_ids[3:].any()
