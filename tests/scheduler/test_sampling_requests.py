"""What the scheduler does for issue 18's sampling requests, checked on the step messages the
workers receive: n completions wait for the first to compute the prompt and then share it through
the prefix cache; prompt_logprobs ask the workers to score each prompt position once (no cache
hits); penalties send the sequence's history on every reset; min_tokens holds eos and stop tokens
back, and the stop token that ends a sequence is recorded."""
import dataclasses

import pytest

from nanoserve.v1 import llm_pb2
from scheduler_svc.completions import completion_sequences
from scheduler_svc.sequence import SamplingOptions, SequenceStatus
from tests.scheduler.test_scheduler_edges import EOS, add, make_scheduler, run_to_end, step

PROMPT = list(range(100, 111))  # 11 tokens: two full blocks of 4, then 3


def new_request(n: int) -> list[llm_pb2.ResumedCompletion]:
    """The completions of a request that resumes nothing: all of them, none begun."""
    return [llm_pb2.ResumedCompletion(index=index) for index in range(n)]


@pytest.mark.parametrize("chunked", [False, True])
def test_later_completions_wait_for_the_first_then_take_its_prompt_blocks(chunked):
    scheduler = make_scheduler(enable_chunked_prefill=chunked)
    seqs = completion_sequences([1, 2, 3], PROMPT, SamplingOptions(max_tokens=3, seed=5, n=3), new_request(3))
    for seq in seqs:
        scheduler.enqueue(seq)
    first = step(scheduler)
    assert [entry.seq_id for entry in first.seqs] == [1]  # the others wait in their place
    second = step(scheduler)
    by_id = {entry.seq_id: entry for entry in second.seqs}
    if chunked:  # the first decodes in the same step, ahead of the others' prompts
        decode = by_id.pop(1)
        assert second.seqs[0] is decode and not decode.reset and decode.num_computed == len(PROMPT)
    # else a prefill step: the first decodes in the next
    assert set(by_id) == {2, 3}
    for seq_id in (2, 3):  # the full prompt blocks come from the cache: only the last block is computed
        assert by_id[seq_id].reset and by_id[seq_id].num_computed == 8 and len(by_id[seq_id].token_ids) == 3
        assert list(by_id[seq_id].new_block_ids[:2]) == seqs[0].block_table[:2]
    assert [seq.num_cached_prompt_tokens for seq in seqs] == [0, 8, 8]
    assert len({entry.sampling.seed for entry in second.seqs if entry.reset}) == 2  # seeds of their own
    run_to_end(scheduler)
    assert scheduler.num_free_blocks == scheduler.num_total_blocks


def test_a_later_completion_goes_on_when_the_first_ends_without_a_token():
    scheduler = make_scheduler()
    seqs = completion_sequences([1, 2], PROMPT, SamplingOptions(max_tokens=2, n=2), new_request(2))
    for seq in seqs:
        scheduler.enqueue(seq)
    scheduler.abort(1)
    assert [entry.seq_id for entry in step(scheduler).seqs] == [2]


def test_prompt_positions_are_scored_once_without_cache_hits():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, 1, PROMPT, max_tokens=1)
    run_to_end(scheduler)  # PROMPT's full blocks are cached now
    seq = add(scheduler, 2, PROMPT, max_tokens=2, prompt_logprobs=2)
    chunks = [step(scheduler) for _ in range(2)]
    entries = [entry for request in chunks for entry in request.seqs]
    assert [entry.num_computed for entry in entries] == [0, 8]  # computed from the start: no hits
    targets = [list(entry.prompt_logprob_targets) for entry in entries]
    assert targets == [PROMPT[1:9], PROMPT[9:11]]  # each position against the token after it
    assert seq.num_scored_prompt_tokens == len(PROMPT) - 1
    assert not any(entry.prompt_logprob_targets for entry in step(scheduler).seqs)  # decoding


def test_a_sequence_with_penalties_sends_its_history_on_every_reset():
    scheduler = make_scheduler(num_kv_blocks=4)
    other = add(scheduler, 1, list(range(10, 18)), max_tokens=3)
    penalized = add(scheduler, 2, list(range(20, 27)), max_tokens=4, repetition_penalty=1.2)
    first = step(scheduler, token_id=5)
    assert list(first.seqs[1].history_token_ids) == list(range(20, 27)) and not first.seqs[0].history_token_ids
    step(scheduler, token_id=6)  # the pool runs dry: the newest (penalized) is preempted
    assert penalized.status is SequenceStatus.WAITING
    while penalized.status is SequenceStatus.WAITING:
        request = step(scheduler, token_id=7)
    (recompute,) = [entry for entry in request.seqs if entry.seq_id == 2]
    assert recompute.reset and recompute.num_generated == 1
    assert list(recompute.history_token_ids) == list(range(20, 27)) + [5]
    assert other.status is SequenceStatus.FINISHED


def test_min_tokens_holds_eos_and_stop_tokens_back_then_records_the_stop_token():
    scheduler = make_scheduler()
    seq = add(scheduler, 1, [1, 2, 3], min_tokens=2, stop_token_ids=(9,))
    for token in (EOS, 9):  # within min_tokens: neither stops it
        step(scheduler, token_id=token)
    assert seq.status is SequenceStatus.RUNNING
    step(scheduler, token_id=9)
    assert (seq.completion_token_ids, seq.finish_reason, seq.stop_reason) == ([EOS, 9, 9], "stop", 9)


def test_eos_stops_without_a_stop_reason():
    scheduler = make_scheduler()
    seq = add(scheduler, 1, [1, 2, 3])
    step(scheduler, token_id=EOS)
    assert (seq.finish_reason, seq.stop_reason) == ("stop", None)


def test_the_workers_get_every_control_they_apply():
    scheduler = make_scheduler()
    options = dict(top_p=0.9, top_k=50, min_p=0.1, repetition_penalty=1.1, presence_penalty=0.5,
                   frequency_penalty=-0.5, min_tokens=2, logit_bias=((5, 1.5),), logprobs=3, prompt_logprobs=1)
    add(scheduler, 1, [1, 2, 3], stop=("x",), n=1, **options)
    (entry,) = step(scheduler).seqs
    sampling = entry.sampling
    sent = {name: getattr(sampling, name) for name in options if name != "logit_bias"}
    assert sent == pytest.approx({name: value for name, value in options.items() if name != "logit_bias"})
    assert dict(sampling.logit_bias) == {5: 1.5} and not sampling.stop  # stop strings stay here


def test_options_keep_todays_behaviour_by_default():
    defaults = SamplingOptions()
    neutral = dict(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                   frequency_penalty=0.0, logit_bias=(), min_tokens=0, stop=(), include_stop_str_in_output=False,
                   logprobs=None, prompt_logprobs=None, n=1)
    assert {name: getattr(defaults, name) for name in neutral} == neutral
    assert not defaults.has_penalties and dataclasses.replace(defaults, presence_penalty=0.1).has_penalties
