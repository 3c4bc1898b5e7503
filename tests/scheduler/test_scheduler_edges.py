"""Edge cases of the scheduler, checked on the step messages the workers would receive."""
from typing import NamedTuple

import pytest

from nanoserve.step_rows import StepEntry, unpack_step
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.scheduler import AdmissionError, Scheduler
from scheduler_svc.sequence import SamplingOptions, Sequence, SequenceStatus
from scheduler_svc.step_encoder import encode_step
from scheduler_svc.step_plan import StepPlan

EOS = 0
BLOCK_SIZE = 4


def make_scheduler(**overrides) -> Scheduler:
    config = dict(num_kv_blocks=16, block_size=BLOCK_SIZE, max_model_len=64, eos_token_ids=(EOS,),
                  max_num_seqs=8, max_num_batched_tokens=32)
    return Scheduler(SchedulerConfig(**{**config, **overrides}))


def add(scheduler: Scheduler, seq_id: int, prompt: list[int], **sampling) -> Sequence:
    seq = Sequence(seq_id, prompt, SamplingOptions(**sampling))
    scheduler.enqueue(seq)
    return seq


class SentStep(NamedTuple):
    """A step as the workers read it: its entries, and the sequences they forget first."""
    seqs: list[StepEntry]
    forget_seq_ids: list[int]


def sent(plan: StepPlan) -> SentStep:
    request = encode_step(plan)
    return SentStep(unpack_step(request), list(request.forget_seq_ids))


def step(scheduler: Scheduler, token_id: int = 9) -> SentStep:
    """Runs one step in which every sampling entry draws token_id."""
    plan = scheduler.schedule()
    scheduler.postprocess(plan, [token_id] * len(plan.sampled))
    return sent(plan)


def run_to_end(scheduler: Scheduler) -> None:
    while scheduler.has_work():
        step(scheduler)


def test_prompt_of_exactly_one_block():
    scheduler = make_scheduler()
    seq = add(scheduler, 1, [1, 2, 3, 4], max_tokens=3)
    (entry,) = step(scheduler).seqs
    assert list(entry.token_ids) == [1, 2, 3, 4] and entry.num_computed == 0
    assert entry.reset and entry.sample and entry.sampling.max_tokens == 3
    assert len(entry.new_block_ids) == 1
    (block_id,) = entry.new_block_ids
    manager = scheduler.block_manager
    assert manager.hash_to_block_id == {manager.blocks[block_id].hash: block_id}  # hashed once computed
    (decode,) = step(scheduler).seqs  # position 4 opens the second block
    assert list(decode.token_ids) == [9] and decode.num_computed == 4 and not decode.reset
    assert len(decode.new_block_ids) == 1 and decode.new_block_ids[0] != entry.new_block_ids[0]
    assert seq.block_table == [entry.new_block_ids[0], decode.new_block_ids[0]]
    run_to_end(scheduler)
    # The same prompt again: its only block holds the last token, which must be computed.
    add(scheduler, 2, [1, 2, 3, 4], max_tokens=1)
    (again,) = step(scheduler).seqs
    assert again.num_computed == 0 and list(again.token_ids) == [1, 2, 3, 4]
    assert scheduler.prefix_cache_hit_tokens == 0


def test_prompt_one_token_past_a_block_boundary_hits_the_full_block():
    scheduler = make_scheduler()
    add(scheduler, 1, [1, 2, 3, 4, 5], max_tokens=1)
    (first,) = step(scheduler).seqs
    assert len(first.new_block_ids) == 2
    second = add(scheduler, 2, [1, 2, 3, 4, 5], max_tokens=1)
    (entry,) = step(scheduler).seqs
    assert entry.reset and entry.num_computed == 4 and list(entry.token_ids) == [5]
    assert entry.new_block_ids[0] == first.new_block_ids[0] and len(entry.new_block_ids) == 2
    assert second.num_cached_prompt_tokens == 4 and scheduler.prefix_cache_hit_tokens == 4


def test_fully_cached_prompt_still_computes_its_last_block():
    scheduler = make_scheduler()
    add(scheduler, 1, list(range(1, 9)), max_tokens=1)
    run_to_end(scheduler)
    assert len(scheduler.block_manager.hash_to_block_id) == 2  # both blocks are cached
    add(scheduler, 2, list(range(1, 9)), max_tokens=1)
    (entry,) = step(scheduler).seqs
    assert entry.num_computed == 4 and list(entry.token_ids) == [5, 6, 7, 8] and entry.sample


def test_max_tokens_one_finishes_after_prefill_and_frees_at_once():
    scheduler = make_scheduler()
    seq = add(scheduler, 1, [1, 2, 3, 4, 5, 6], max_tokens=1)
    plan = scheduler.schedule()
    assert scheduler.postprocess(plan, [7]) == [seq]
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
    assert seq.completion_token_ids == [7] and seq.block_table == []
    assert scheduler.num_free_blocks == scheduler.num_total_blocks and not scheduler.has_work()
    assert scheduler.schedule() is None
    add(scheduler, 2, [3, 3])
    assert list(step(scheduler).forget_seq_ids) == [1]  # the forget rode on the next real step


@pytest.mark.parametrize("ignore_eos, expected", [(False, ([EOS], "stop")), (True, ([EOS, EOS], "length"))])
def test_eos_as_first_generated_token(ignore_eos, expected):
    scheduler = make_scheduler()
    seq = add(scheduler, 1, [1, 2, 3], max_tokens=2, ignore_eos=ignore_eos)
    while scheduler.has_work():
        step(scheduler, token_id=EOS)
    assert (seq.completion_token_ids, seq.finish_reason) == expected


def test_stop_token_stops_even_when_eos_is_ignored():
    scheduler = make_scheduler()
    seq = add(scheduler, 1, [1, 2, 3], ignore_eos=True, stop_token_ids=(9,))
    step(scheduler, token_id=9)
    assert (seq.completion_token_ids, seq.finish_reason) == ([9], "stop")


def test_identical_prompts_admitted_in_the_same_step():
    scheduler = make_scheduler()
    prompt = list(range(1, 10))
    first, second = add(scheduler, 1, prompt, max_tokens=2), add(scheduler, 2, prompt, max_tokens=2)
    request = step(scheduler)
    # Nothing was computed before this step, so neither may reuse the other's blocks.
    assert [entry.num_computed for entry in request.seqs] == [0, 0]
    assert not set(first.block_table) & set(second.block_table)
    run_to_end(scheduler)
    assert scheduler.num_free_blocks == scheduler.num_total_blocks
    assert all(block.ref_count == 0 for block in scheduler.block_manager.blocks)
    add(scheduler, 3, prompt, max_tokens=1)
    assert step(scheduler).seqs[0].num_computed == 8


def test_cached_block_revived_from_the_free_list():
    scheduler = make_scheduler()
    add(scheduler, 1, list(range(1, 10)), max_tokens=1)
    (first,) = step(scheduler).seqs
    assert scheduler.num_free_blocks == scheduler.num_total_blocks  # finished: all free, hashes kept
    add(scheduler, 2, list(range(1, 9)) + [42], max_tokens=1)
    plan = scheduler.schedule()
    (entry,) = sent(plan).seqs
    assert list(entry.new_block_ids[:2]) == list(first.new_block_ids[:2]) and entry.num_computed == 8
    assert scheduler.num_free_blocks == scheduler.num_total_blocks - 3
    ref_counts = [scheduler.block_manager.blocks[block_id].ref_count for block_id in entry.new_block_ids]
    assert ref_counts == [1, 1, 1]


def test_chunked_prefill_continues_before_admitting_more():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    add(scheduler, 1, list(range(1, 21)), max_tokens=1)
    add(scheduler, 2, [50, 51, 52], max_tokens=1)
    chunks = []
    while scheduler.has_work():
        chunks.append([(entry.seq_id, entry.num_computed, len(entry.token_ids), entry.sample, entry.reset)
                       for entry in step(scheduler).seqs])
    assert chunks == [[(1, 0, 8, False, True)],
                      [(1, 8, 8, False, False)],
                      [(1, 16, 4, True, False), (2, 0, 3, True, True)]]


def test_preemption_takes_the_newest_and_recomputes_it():
    scheduler = make_scheduler(num_kv_blocks=6, enable_chunked_prefill=False)
    oldest = add(scheduler, 1, list(range(10, 18)), max_tokens=2)
    middle = add(scheduler, 2, list(range(20, 28)), max_tokens=3)
    newest = add(scheduler, 3, list(range(30, 37)), max_tokens=3)
    step(scheduler, token_id=5)  # all three prefilled: the pool is full
    assert scheduler.num_free_blocks == 0
    request = step(scheduler, token_id=6)  # the two older ones each need a block
    assert [entry.seq_id for entry in request.seqs] == [1, 2]
    assert list(request.forget_seq_ids) == [3]
    assert newest.status is SequenceStatus.WAITING and newest.block_table == []
    assert list(scheduler.waiting) == [newest] and scheduler.running == [middle]  # oldest finished
    (recompute,) = step(scheduler, token_id=7).seqs
    assert recompute.seq_id == 3 and recompute.reset and recompute.num_computed == 0
    assert list(recompute.token_ids) == list(range(30, 37)) + [5] and recompute.num_generated == 1
    run_to_end(scheduler)
    assert oldest.completion_token_ids == [5, 6] and newest.completion_token_ids == [5, 7, 9]


def test_abort_while_waiting_running_and_in_flight():
    scheduler = make_scheduler()
    running, in_flight = add(scheduler, 1, [1, 2, 3]), add(scheduler, 2, [4, 5, 6])
    step(scheduler)
    waiting = add(scheduler, 3, [7, 8])
    assert scheduler.abort(3) is waiting and waiting.status is SequenceStatus.FINISHED
    assert waiting.finish_reason is None and scheduler.num_waiting == 0
    plan = scheduler.schedule()
    assert scheduler.abort(2) is in_flight
    assert scheduler.postprocess(plan, [11, 12]) == [running]
    assert running.completion_token_ids == [9, 11] and in_flight.completion_token_ids == [9]
    assert scheduler.abort(1) is running and scheduler.abort(1) is None
    assert scheduler.num_free_blocks == scheduler.num_total_blocks and not scheduler.has_work()
    add(scheduler, 4, [1])
    assert sorted(step(scheduler).forget_seq_ids) == [1, 2]  # never 3: the workers never saw it


def test_decode_entries_stay_small_whatever_the_context():
    scheduler = make_scheduler(num_kv_blocks=600, max_model_len=4096, max_num_batched_tokens=4096)
    add(scheduler, 1, [1] * 5)
    add(scheduler, 2, [2] * 2001)
    step(scheduler)
    plan = scheduler.schedule()
    request = encode_step(plan)
    short, long = unpack_step(request)
    for entry in (short, long):
        assert len(entry.token_ids) == 1 and not entry.reset and entry.sampling is None
    assert long.num_computed == 2001 and not request.extras  # no blocks, no options: the columns alone
    assert request.ByteSize() <= 40  # per entry ~11 bytes of columns (3 for a context of 2,001), plus their tags


@pytest.mark.parametrize("max_tokens", [None, 100])
def test_generation_stops_at_the_model_length_limit(max_tokens):
    scheduler = make_scheduler(max_model_len=12)
    seq = add(scheduler, 1, list(range(1, 9)), max_tokens=max_tokens, ignore_eos=True)
    run_to_end(scheduler)
    assert len(seq.completion_token_ids) == 4 and seq.finish_reason == "length"


def test_generation_stops_where_the_pool_ends():
    scheduler = make_scheduler(num_kv_blocks=3, max_model_len=64)
    seq = add(scheduler, 1, list(range(1, 11)), ignore_eos=True)
    run_to_end(scheduler)
    assert len(seq) == 12 and seq.finish_reason == "length"


def test_requests_that_can_never_run_are_refused():
    scheduler = make_scheduler(num_kv_blocks=4, max_model_len=20)
    with pytest.raises(AdmissionError, match="prompt has 20 tokens but the model's limit is 20") as too_long:
        add(scheduler, 1, list(range(20)))
    with pytest.raises(AdmissionError, match="needs 5 KV blocks of 4 tokens but the pool has 4") as too_big:
        add(scheduler, 2, list(range(17)))
    with pytest.raises(AdmissionError, match="empty") as empty:
        add(scheduler, 3, [])
    assert (too_long.value.kind, too_big.value.kind, empty.value.kind) == ("invalid", "exhausted", "invalid")
    assert not scheduler.has_work()
    add(scheduler, 4, list(range(16)))  # exactly the whole pool is fine


def test_postprocess_rejects_a_wrong_token_count():
    scheduler = make_scheduler()
    add(scheduler, 1, [1, 2])
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="sampled 1 sequences but 2 tokens came back"):
        scheduler.postprocess(plan, [3, 4])


def test_config_without_a_decode_token_per_sequence_is_refused():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_num_seqs=64, max_num_batched_tokens=32)
