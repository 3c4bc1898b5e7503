"""Scheduler.drop_kv, the scheduler's part of recovering from a lost worker group: with steps still in
flight, every sequence goes back to waiting (the running ones first, as preempted), the workers'
next steps reset each of them with its prompt and the tokens of completed steps only, and the
sampling positions carry on where the completed tokens end."""
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import SamplingOptions, Sequence, SequenceStatus
from tests.scheduler.test_scheduler_edges import sent

BLOCK_SIZE = 4


def make_scheduler(num_kv_blocks: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE, max_model_len=64,
                                     max_num_seqs=2, max_num_batched_tokens=32))


def add(scheduler: Scheduler, seq_id: int, prompt: list[int]) -> Sequence:
    seq = Sequence(seq_id, prompt, SamplingOptions(max_tokens=20, ignore_eos=True, temperature=1.0, seed=seq_id))
    scheduler.enqueue(seq)
    return seq


def test_drop_kv_requeues_running_first_and_recomputes_only_completed_tokens():
    scheduler = make_scheduler()
    first, second = add(scheduler, 1, [1, 2, 3, 4, 5]), add(scheduler, 2, [6, 7, 8])
    third = add(scheduler, 3, [9, 10])  # waits: max_num_seqs is 2
    done = scheduler.schedule()
    scheduler.postprocess(done, [11, 12])
    in_flight = [scheduler.schedule(), scheduler.schedule()]  # their tokens never come back
    assert all(plan.sampled == [first, second] for plan in in_flight)

    assert scheduler.drop_kv(16) == []
    assert list(scheduler.waiting) == [first, second, third]
    assert scheduler.num_running == 0 and scheduler.num_free_blocks == 16
    assert scheduler.block_manager.hash_to_block_id == {}
    assert scheduler.num_preemptions == 2
    for seq in (first, second, third):
        assert seq.status is SequenceStatus.WAITING and seq.block_table == []
        assert (seq.num_computed_tokens, seq.num_pending_tokens, seq.num_steps_in_flight) == (0, 0, 0)

    entries = sent(scheduler.schedule()).seqs
    assert [list(entry.token_ids) for entry in entries] == [[1, 2, 3, 4, 5, 11], [6, 7, 8, 12]]
    assert all(entry.reset and entry.sample for entry in entries)
    # The next token of each is its second: seeded draws are keyed by that position.
    assert [entry.num_generated for entry in entries] == [1, 1]


def test_sequences_that_outgrow_a_smaller_pool_are_finished():
    scheduler = make_scheduler()
    long, short = add(scheduler, 1, list(range(1, 14))), add(scheduler, 2, [1, 2])
    scheduler.postprocess(scheduler.schedule(), [20, 21])
    lost = scheduler.drop_kv(3)  # 12 tokens: the long one's 14 no longer fit
    assert lost == [long] and long.status is SequenceStatus.FINISHED and long.finish_reason is None
    assert list(scheduler.waiting) == [short] and scheduler.num_total_blocks == 3
    assert scheduler.abort(long.seq_id) is None


def test_a_smaller_pool_ends_the_survivors_at_its_size():
    """A sequence that still fits the new pool stops with "length" where the pool ends (12 tokens here),
    before its own max_tokens (20), and is never scheduled past it."""
    scheduler = make_scheduler()
    seq = add(scheduler, 1, [1, 2, 3, 4, 5])
    scheduler.postprocess(scheduler.schedule(), [6])
    assert scheduler.drop_kv(3) == []
    tokens = 7
    while (plan := scheduler.schedule()) is not None:
        assert all(start + count <= 12 for start, count in zip(plan.num_computed, plan.num_tokens))
        scheduler.postprocess(plan, [tokens] * len(plan.sampled))
        tokens += 1
    assert (seq.finish_reason, len(seq.token_ids), len(seq.completion_token_ids)) == ("length", 12, 7)
