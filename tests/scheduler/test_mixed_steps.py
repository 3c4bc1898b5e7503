"""The step policy (issue 15): with chunked prefill every step decodes the running sequences first and
fills the rest of its token budget with prompt chunks; without it a step either prefills whole prompts
or decodes. Checked on the step messages the workers receive."""
import pytest

from scheduler_svc.sequence import SequenceStatus
from tests.scheduler.test_scheduler_edges import add, make_scheduler, run_to_end, step


def shape(request) -> list[tuple[int, int, int, bool]]:
    """(seq id, first position, tokens sent, samples) of each entry."""
    return [(entry.seq_id, entry.num_computed, len(entry.token_ids), entry.sample) for entry in request.seqs]


def test_a_long_prompt_is_split_without_stalling_the_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=32)
    add(scheduler, 1, [1, 2, 3], ignore_eos=True)
    add(scheduler, 2, [4, 5], ignore_eos=True)
    step(scheduler)
    long = add(scheduler, 3, list(range(10, 30)), ignore_eos=True)  # 20 tokens
    steps = [shape(step(scheduler)) for _ in range(4)]
    assert steps == [[(1, 3, 1, True), (2, 2, 1, True), (3, 0, 6, False)],
                     [(1, 4, 1, True), (2, 3, 1, True), (3, 6, 6, False)],
                     [(1, 5, 1, True), (2, 4, 1, True), (3, 12, 6, False)],
                     [(1, 6, 1, True), (2, 5, 1, True), (3, 18, 2, True)]]
    assert long.completion_token_ids == [9]
    assert shape(step(scheduler))[2] == (3, 20, 1, True)  # now it decodes with the others


def test_prompts_part_way_continue_before_admissions():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=32)
    add(scheduler, 1, list(range(10, 23)), max_tokens=2)  # 13 tokens
    add(scheduler, 2, [4, 5, 6], max_tokens=2)
    assert shape(step(scheduler)) == [(1, 0, 8, False)]
    assert shape(step(scheduler)) == [(1, 8, 5, True), (2, 0, 3, True)]
    assert shape(step(scheduler)) == [(1, 13, 1, True), (2, 3, 1, True)]


def test_long_prefill_threshold_caps_each_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=32,
                               long_prefill_token_threshold=5)
    add(scheduler, 1, list(range(10, 22)), max_tokens=1)  # 12 tokens
    add(scheduler, 2, list(range(30, 37)), max_tokens=1)  # 7 tokens
    add(scheduler, 3, [1, 2], max_tokens=1)
    assert shape(step(scheduler)) == [(1, 0, 5, False), (2, 0, 5, False), (3, 0, 2, True)]
    assert shape(step(scheduler)) == [(1, 5, 5, False), (2, 5, 2, True)]
    assert shape(step(scheduler)) == [(1, 10, 2, True)]
    assert not scheduler.has_work()


def test_preemption_in_a_mixed_step_recomputes_beside_the_decodes():
    scheduler = make_scheduler(num_kv_blocks=6)
    oldest = add(scheduler, 1, list(range(10, 18)), max_tokens=2)
    middle = add(scheduler, 2, list(range(20, 28)), max_tokens=3)
    newest = add(scheduler, 3, list(range(30, 37)), max_tokens=3)
    step(scheduler, token_id=5)  # all three prefilled: the pool is full
    request = step(scheduler, token_id=6)  # the two older ones each need a block; no room to readmit
    assert [entry.seq_id for entry in request.seqs] == [1, 2] and list(request.forget_seq_ids) == [3]
    assert newest.status is SequenceStatus.WAITING
    decode, recompute = step(scheduler, token_id=7).seqs  # the oldest finished: room again
    assert (decode.seq_id, decode.reset, recompute.seq_id, recompute.reset) == (2, False, 3, True)
    assert list(recompute.token_ids) == list(range(30, 37)) + [5] and recompute.num_computed == 0
    run_to_end(scheduler)
    assert oldest.completion_token_ids == [5, 6] and middle.completion_token_ids == [5, 6, 7]
    assert newest.completion_token_ids == [5, 7, 9]


def test_without_chunked_prefill_steps_prefill_whole_prompts_or_decode():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=32,
                               enable_chunked_prefill=False, long_prefill_token_threshold=2)  # ignored
    add(scheduler, 1, [1, 2, 3], ignore_eos=True)
    step(scheduler)
    add(scheduler, 2, [4, 5, 6, 7, 8], max_tokens=1)
    add(scheduler, 3, [4, 5, 6, 7], max_tokens=1)  # does not fit beside the first: waits whole
    add(scheduler, 4, list(range(40, 52)), max_tokens=1)  # longer than the budget: split, alone
    assert shape(step(scheduler)) == [(2, 0, 5, True)]
    assert shape(step(scheduler)) == [(3, 0, 4, True)]
    assert shape(step(scheduler)) == [(4, 0, 8, False)]
    assert shape(step(scheduler)) == [(4, 8, 4, True)]
    assert shape(step(scheduler)) == [(1, 3, 1, True)]  # decodes only once nothing is left to prefill


def test_a_negative_long_prefill_threshold_is_refused():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        make_scheduler(long_prefill_token_threshold=-1)
