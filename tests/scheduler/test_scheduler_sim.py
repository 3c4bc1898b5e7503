"""The scheduler end to end against a fake worker whose next token is a pure function of the
token history, so every correct schedule yields the same tokens.

The fake worker sees only the step messages. It rebuilds block tables from their deltas,
stores (position, token) in a paged pool as its "KV", and reads each history back from the
pool before answering: a wrong block table, a stale prefix-cache hit, a missed forget or a
bad recompute after preemption changes the tokens.
"""
import random
from array import array
from collections import deque
from dataclasses import dataclass, field

import pytest
import xxhash

from nanoserve.step_rows import StepEntry, unpack_step
from nanoserve.v1 import worker_pb2
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import SamplingOptions, Sequence
from scheduler_svc.step_encoder import encode_step

VOCAB = 64
EOS = 0
BLOCK_SIZE = 4
MAX_MODEL_LEN = 160
SHARED_PREFIXES = [[], [7] * 8, list(range(1, 14)), list(range(20, 44))]


def next_token(history: list[int]) -> int:
    return xxhash.xxh64_intdigest(array("I", history).tobytes()) % VOCAB


def expected_completion(prompt: list[int], sampling: SamplingOptions) -> tuple[list[int], str]:
    """What any correct engine must produce: the fake model run one token at a time."""
    history, completion = list(prompt), []
    while True:
        token = next_token(history)
        history.append(token)
        completion.append(token)
        if token in sampling.stop_token_ids or (token == EOS and not sampling.ignore_eos):
            return completion, "stop"
        if len(completion) == sampling.max_tokens or len(history) >= MAX_MODEL_LEN:
            return completion, "length"


@dataclass
class WireStats:
    recomputes: int = 0            # reset entries for a sequence the worker knew before
    partial_chunks: int = 0        # prefill entries that do not sample
    cross_request_hits: int = 0    # first admissions that start past cached tokens
    fed_tokens: int = 0            # decode entries without a token: the worker's own sample fed in
    mixed_steps: int = 0           # steps with decode entries and prompt entries
    longest_entry: int = 0         # the most tokens one entry computed
    seen: set[int] = field(default_factory=set)


class PagedFakeWorker:
    def __init__(self, num_blocks: int):
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * BLOCK_SIZE)
        self.tables: dict[int, list[int]] = {}
        self.last_sampled: dict[int, tuple[int, int]] = {}  # seq id -> (position, token) of its last sample
        self.stats = WireStats()

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    def step(self, request: worker_pb2.StepRequest) -> list[int]:
        for seq_id in request.forget_seq_ids:
            del self.tables[seq_id]
            self.last_sampled.pop(seq_id, None)
        # Decodes lead: a worker may run the step's leading one-token entries as decodes.
        entries = unpack_step(request)
        is_prompt = [entry.reset or len(entry.token_ids) > 1 for entry in entries]
        assert is_prompt == sorted(is_prompt), "a decode entry after a prompt entry"
        self.stats.mixed_steps += 0 < sum(is_prompt) < len(is_prompt)
        self.stats.longest_entry = max(self.stats.longest_entry, *(len(entry.token_ids) for entry in entries))
        # Like a forward pass: every entry's KV is stored before any attention reads it.
        for entry in entries:
            self._apply_delta(entry)
            table = self.tables[entry.seq_id]
            for offset, token in enumerate(entry.token_ids or self._fed_token(entry)):
                position = entry.num_computed + offset
                self.slots[self._slot(table, position)] = (position, token)
        return [self._sample(entry) for entry in entries if entry.sample]

    def _fed_token(self, entry: StepEntry) -> list[int]:
        position, token = self.last_sampled[entry.seq_id]
        assert position == entry.num_computed and not entry.reset
        self.stats.fed_tokens += 1
        return [token]

    def _apply_delta(self, entry: StepEntry) -> None:
        stats = self.stats
        if entry.reset:
            assert entry.seq_id not in self.tables, "reset of a sequence the worker was not told to forget"
            assert entry.sampling is not None
            stats.recomputes += entry.seq_id in stats.seen
            stats.cross_request_hits += entry.seq_id not in stats.seen and entry.num_computed > 0
            stats.seen.add(entry.seq_id)
            self.tables[entry.seq_id] = list(entry.new_block_ids)
        else:
            assert entry.sampling is None and len(entry.new_block_ids) <= 1
            self.tables[entry.seq_id].extend(entry.new_block_ids)
        stats.partial_chunks += not entry.sample

    def _sample(self, entry: StepEntry) -> int:
        table = self.tables[entry.seq_id]
        history = []
        for position in range(entry.num_computed + max(1, len(entry.token_ids))):
            stored_position, token = self.slots[self._slot(table, position)]
            assert stored_position == position
            history.append(token)
        token = next_token(history)
        self.last_sampled[entry.seq_id] = (len(history), token)
        return token


def make_requests(rng: random.Random, count: int) -> list[tuple[list[int], SamplingOptions]]:
    requests = []
    for _ in range(count):
        prompt = rng.choice(SHARED_PREFIXES) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 60))]
        sampling = SamplingOptions(max_tokens=rng.choice([None, 1, 2, rng.randint(3, 40)]),
                                   ignore_eos=rng.random() < 0.3,
                                   stop_token_ids=(rng.randrange(1, VOCAB),) if rng.random() < 0.2 else ())
        requests.append((prompt, sampling))
    return requests


def run(config: SchedulerConfig, requests, rng: random.Random, arrivals_per_step: int, abort_rate: float = 0.0,
        depth: int = 1) -> tuple[dict[int, Sequence], set[int], Scheduler, PagedFakeWorker]:
    """Feeds the requests in over time, with some aborted part-way; returns every sequence.
    With `depth` > 1, as the engine runs it: up to depth steps are scheduled (and computed by the
    worker, which works in order) before the oldest is post-processed."""
    scheduler, worker = Scheduler(config), PagedFakeWorker(config.num_kv_blocks)
    seqs = {seq_id: Sequence(seq_id, prompt, sampling) for seq_id, (prompt, sampling) in enumerate(requests)}
    pending, aborted = list(seqs.values()), set()
    in_flight: deque = deque()  # steps computed whose tokens the scheduler has not seen yet
    while pending or scheduler.has_work():
        for seq in pending[:arrivals_per_step]:
            scheduler.enqueue(seq)
        del pending[:arrivals_per_step]
        if rng.random() < abort_rate and (scheduler.running or scheduler.waiting):
            victim = rng.choice(list(scheduler.running) + list(scheduler.waiting))
            assert scheduler.abort(victim.seq_id) is victim
            aborted.add(victim.seq_id)
        plan = scheduler.schedule()
        if plan is not None:
            in_flight.append((plan, worker.step(encode_step(plan))))
        if in_flight and (plan is None or len(in_flight) == depth):
            done, tokens = in_flight.popleft()
            served = scheduler.postprocess(done, tokens)
            assert set(served) <= set(done.sampled)
            assert depth > 1 or served == done.sampled
    while in_flight:
        scheduler.postprocess(*in_flight.popleft())
    return seqs, aborted, scheduler, worker


# (seed, steps in flight, chunked prefill, long prefill threshold): mixed steps (the default), steps
# that either prefill or decode, and mixed steps with a cap on each prompt's chunk.
@pytest.mark.parametrize("seed, depth, chunked, threshold", [
    (0, 1, True, 0), (1, 1, False, 0), (2, 2, True, 0), (3, 2, False, 0), (4, 3, True, 0), (5, 3, True, 6),
    (6, 1, True, 5)])
def test_constrained_schedule_gives_the_unconstrained_tokens(seed, depth, chunked, threshold):
    rng = random.Random(seed)
    requests = make_requests(rng, 300)
    tight = SchedulerConfig(num_kv_blocks=48, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                            eos_token_ids=(EOS,), max_num_seqs=8, max_num_batched_tokens=32,
                            enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold)
    roomy = SchedulerConfig(num_kv_blocks=len(requests) * MAX_MODEL_LEN // BLOCK_SIZE, block_size=BLOCK_SIZE,
                            max_model_len=MAX_MODEL_LEN, eos_token_ids=(EOS,), max_num_seqs=len(requests),
                            max_num_batched_tokens=100_000, enable_prefix_caching=False)

    tight_seqs, aborted, scheduler, worker = run(tight, requests, rng, arrivals_per_step=2, abort_rate=0.003,
                                                 depth=depth)
    roomy_seqs, _, roomy_scheduler, roomy_worker = run(roomy, requests, rng, arrivals_per_step=len(requests),
                                                       depth=depth)

    assert roomy_worker.stats.recomputes == roomy_worker.stats.partial_chunks == 0
    assert roomy_scheduler.prefix_cache_hit_tokens == 0
    for seq_id, (prompt, sampling) in enumerate(requests):
        expected = expected_completion(prompt, sampling)
        roomy_seq, tight_seq = roomy_seqs[seq_id], tight_seqs[seq_id]
        assert (roomy_seq.completion_token_ids, roomy_seq.finish_reason) == expected
        if seq_id in aborted:
            assert tight_seq.finish_reason is None
            assert tight_seq.completion_token_ids == expected[0][:len(tight_seq.completion_token_ids)]
        else:
            assert (tight_seq.completion_token_ids, tight_seq.finish_reason) == expected
    assert 0 < len(aborted) < len(requests) // 10

    stats = worker.stats
    assert stats.recomputes > 10 and stats.partial_chunks > 10 and stats.cross_request_hits > 10
    assert (stats.fed_tokens > 100) == (depth > 1)
    assert (stats.mixed_steps > 100) == chunked and (stats.mixed_steps == 0) == (not chunked)
    assert stats.longest_entry == (threshold or tight.max_num_batched_tokens)
    assert scheduler.prefix_cache_hit_tokens > 0
    assert scheduler.num_free_blocks == scheduler.num_total_blocks
    assert not scheduler.has_work() and scheduler.live == {}
    # The last finishes are still to be forgotten; they ride on the next step.
    assert set(worker.tables) == set(scheduler.forget_seq_ids)
