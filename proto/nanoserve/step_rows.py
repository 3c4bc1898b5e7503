"""A StepRequest as rows, one StepEntry per entry, for code off the hot path: the worker's warm-up
steps, benchmarks, and tests that write or read steps by hand. The scheduler's encoder writes the
columns straight from its plan, and the worker's sequence table reads them as columns. Also the
count of rows a step computes (num_rows), which the worker checks against its limits."""
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from nanoserve.v1 import llm_pb2, worker_pb2
from nanoserve.wire import pack_token_ids, unpack_token_ids


@dataclass
class StepEntry:
    """One entry of a step: worker.proto's columns at one row, with its EntryExtras."""
    seq_id: int
    token_ids: Sequence[int] = field(default_factory=list)
    num_computed: int = 0
    sample: bool = False
    num_generated: int = 0
    reset: bool = False
    sampling: llm_pb2.SamplingParams | None = None  # on a reset
    new_block_ids: Sequence[int] = field(default_factory=list)
    prompt_logprob_targets: list[int] = field(default_factory=list)
    history_token_ids: list[int] = field(default_factory=list)
    grammar: str = ""  # on a reset of a constrained sequence


def num_rows(num_token_ids: list[int]) -> int:
    """The tokens a step computes, from its num_token_ids: a decode fed its own sampled token computes one."""
    return sum(num_token_ids) + num_token_ids.count(0)


def pack_step(step_id: int, entries: Iterable[StepEntry], forget_seq_ids: Iterable[int] = ()) -> worker_pb2.StepRequest:
    request = worker_pb2.StepRequest(step_id=step_id, forget_seq_ids=forget_seq_ids)
    token_ids = []
    for index, entry in enumerate(entries):
        request.seq_ids.append(entry.seq_id)
        request.num_computed.append(entry.num_computed)
        request.num_token_ids.append(len(entry.token_ids))
        token_ids += entry.token_ids
        request.sample.append(entry.sample)
        request.num_generated.append(entry.num_generated)
        if entry.reset or entry.new_block_ids or entry.prompt_logprob_targets or entry.history_token_ids:
            extras = request.extras.add(entry=index, new_block_ids=entry.new_block_ids, reset=entry.reset,
                                        prompt_logprob_targets=entry.prompt_logprob_targets,
                                        history_token_ids=entry.history_token_ids, grammar=entry.grammar)
            if entry.sampling is not None:
                extras.sampling.CopyFrom(entry.sampling)
    request.token_ids = pack_token_ids(token_ids)
    return request


def unpack_step(request: worker_pb2.StepRequest) -> list[StepEntry]:
    """The entries of a well-formed request (the worker's sequence table checks the columns)."""
    extras = {item.entry: item for item in request.extras}
    token_ids = unpack_token_ids(request.token_ids)
    entries, start = [], 0
    for index, (seq_id, num_computed, count, sample, num_generated) in enumerate(zip(
            request.seq_ids, request.num_computed, request.num_token_ids, request.sample, request.num_generated)):
        entry = StepEntry(seq_id, token_ids[start:start + count], num_computed, sample, num_generated)
        start += count
        if index in extras:
            item = extras[index]
            entry.reset, entry.new_block_ids = item.reset, list(item.new_block_ids)
            entry.sampling = item.sampling if item.HasField("sampling") else None
            entry.prompt_logprob_targets = list(item.prompt_logprob_targets)
            entry.history_token_ids = list(item.history_token_ids)
            entry.grammar = item.grammar
        entries.append(entry)
    return entries
