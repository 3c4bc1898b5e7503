"""Turns a validated step (StepWork columns) into the tensors the model, attention and sampler read.

This runs on the host before every step, so it never loops in Python and allocates no tensors:
per-token columns come from numpy ranges written straight into a staging set of the step buffers,
block tables and sampling parameters from one gather each of the sequence table's rows, and each
used slice then goes to the device buffers in a non_blocking copy (worker_svc.step_buffers says why
that is safe).
"""
from dataclasses import dataclass

import numpy as np
import torch

from nanoserve_kernels.backend import AttentionBackend
from nanoserve_model.sampler import Sampler, SamplingBatch
from nanoserve_model.step_context import StepContext
from worker_svc.sequence_table import SequenceTable, StepWork
from worker_svc.step_buffers import StepBuffers


@dataclass
class StepInputs:
    """Views of the device step buffers."""
    input_ids: torch.Tensor        # [N] every sequence's new tokens, packed
    positions: torch.Tensor        # [N]
    context: StepContext
    sample_indices: torch.Tensor | slice  # [S] rows of the packed tokens whose next token is sampled
    sampled_slots: torch.Tensor    # [S] their sequences' slots (where the sampled tokens are kept)
    sampling: SamplingBatch        # [S] their sampling parameters


def build_step_inputs(work: StepWork, seqs: SequenceTable, backend: AttentionBackend, last_tokens: torch.Tensor,
                      buffers: StepBuffers, sampler: Sampler, num_rows: int) -> StepInputs:
    """`seqs` holds each slot's block table and sampling parameters; `last_tokens` each slot's last
    sampled token, fed in where an entry sends none. `num_rows`: the rows the forward pass computes,
    its CUDA graph's size (a decode's batch bucket, a prefill's token bucket) or the step's own rows
    (sequences of a decode, tokens otherwise); rows past the step's own are padding that every
    kernel skips (slot -1, and in a decode context length 0)."""
    staging = buffers.next_staging()
    host = staging.arrays
    num_seqs, num_tokens = len(work.slots), len(work.token_ids)
    num_new, context_lens, block_size = work.num_new, work.context_lens, buffers.block_size
    ends = np.cumsum(num_new)  # where each entry's rows end in the packed tokens
    # The varlen lengths cover the entries that attend as a prefill: every one, or in a mixed step
    # those after its leading decodes (StepContext.num_decodes), from 0 at the first of them.
    num_decodes = 0 if work.is_decode else leading_decodes(num_new)
    host.cu_seqlens_q[num_decodes] = host.cu_seqlens_k[num_decodes] = 0
    host.cu_seqlens_q[num_decodes + 1:num_seqs + 1] = ends[num_decodes:] - num_decodes
    host.cu_seqlens_k[num_decodes + 1:num_seqs + 1] = np.cumsum(context_lens[num_decodes:])
    host.context_lens[:num_seqs] = context_lens
    # The decode kernel starts the decoding rows' longest contexts first (nanoserve_kernels/triton_decode.py).
    num_decoding = num_seqs if work.is_decode else num_decodes
    host.decode_order[:num_decoding] = np.argsort(-context_lens[:num_decoding], kind="stable")
    if work.is_decode:
        host.context_lens[num_seqs:num_rows] = 0
        host.decode_order[num_seqs:num_rows] = np.arange(num_seqs, num_rows)  # CUDA-graph padding rows, last
    tables = host.block_tables[:num_seqs]
    np.take(seqs.block_tables, work.slots, axis=0, out=tables, mode="clip")  # slots are valid rows
    # Each new token's position, then its slot through its own sequence's block table.
    if work.is_decode:
        seq_of_token, positions = np.arange(num_seqs), work.num_computed
    else:
        seq_of_token = np.repeat(np.arange(num_seqs), num_new)
        positions = np.arange(num_tokens) - (ends - num_new)[seq_of_token] + work.num_computed[seq_of_token]
    host.positions[:num_tokens] = positions
    host.slot_mapping[:num_tokens] = (tables[seq_of_token, positions // block_size].astype(np.int64) * block_size
                                      + positions % block_size)
    host.slot_mapping[num_tokens:num_rows] = -1
    host.input_ids[:num_tokens] = work.token_ids
    num_fed, num_sampled = len(work.fed_rows), len(work.sampled)
    host.fed_rows[:num_fed] = work.fed_rows
    host.fed_slots[:num_fed] = work.fed_slots
    sampled = np.asarray(work.sampled, np.int64)
    sampled_slots = work.slots[sampled]
    temperatures = seqs.temperatures[sampled_slots]
    host.sample_indices[:num_sampled] = ends[sampled] - 1  # each sequence's last new token
    host.sampled_slots[:num_sampled] = sampled_slots
    sampler.stage(temperatures, seqs.seeds[sampled_slots], seqs.seeded[sampled_slots],
                  np.asarray(work.num_generated, np.int64), staging.sampling)
    buffers.upload(staging, num_tokens, max(num_tokens, num_rows), num_seqs, num_fed)

    device = buffers.on_device
    input_ids = device.input_ids[:num_tokens]
    if num_fed == num_tokens:  # every row takes its sequence's last sampled token (a pipelined decode): one gather
        torch.index_select(last_tokens, 0, device.fed_slots[:num_fed], out=input_ids)
    elif num_fed:
        input_ids[device.fed_rows[:num_fed]] = last_tokens[device.fed_slots[:num_fed]]
    if work.is_decode:
        context = buffers.decode_context(backend, num_seqs)
    else:
        context = buffers.context(backend, True, num_tokens, num_seqs, int(work.num_blocks.max()),
                                  int(num_new[num_decodes:].max()), int(context_lens[num_decodes:].max()), num_decodes)
    # A decode that samples every sequence takes rows 0..S-1 in order: a slice of the hidden states, no gather.
    sample_indices = (slice(0, num_sampled) if work.is_decode and num_sampled == num_seqs
                      else device.sample_indices[:num_sampled])
    return StepInputs(input_ids, device.positions[:num_tokens], context, sample_indices,
                      device.sampled_slots[:num_sampled], device.sampling(num_sampled, not temperatures.any()))


def leading_decodes(num_new: np.ndarray) -> int:
    """The entries before the first that computes more than one token. The scheduler puts a mixed
    step's decodes first; each computes one query over its whole context, as a decode step does,
    so they attend through the decode kernel, whose GQA grouping and split context suit one query."""
    longer = np.flatnonzero(num_new != 1)
    return int(longer[0]) if len(longer) else len(num_new)
