"""GetStats' step counters (step_totals.Totals): each step's rank-0 timings are added to its kind."""
from nanoserve.v1 import worker_pb2
from scheduler_svc.sequence import SamplingOptions, Sequence
from scheduler_svc.step_plan import StepPlan
from scheduler_svc.step_totals import Totals


def _sequence(seq_id: int, prompt_len: int) -> Sequence:
    seq = Sequence(seq_id, list(range(1, prompt_len + 1)), SamplingOptions())
    seq.block_table = [seq_id]
    return seq


def test_step_timings_add_up_by_kind():
    totals = Totals()
    a, b = _sequence(1, 5), _sequence(2, 1)
    prefill = StepPlan.build(1, [a], [5], [])
    a.num_pending_tokens = b.num_pending_tokens = 0  # as if the prefill's token came back
    a.token_ids.append(7)
    b.num_blocks_on_workers, b.num_computed_tokens, b.token_ids = 1, 1, [1, 7]
    decode = StepPlan.build(2, [a, b], [1, 1], [])
    totals.record_step(prefill, worker_pb2.StepResponse(busy_seconds=0.5, host_seconds=0.25, idle_seconds=9))
    totals.record_step(decode, worker_pb2.StepResponse(busy_seconds=0.125, host_seconds=0.0625, idle_seconds=2))
    totals.record_step(decode, worker_pb2.StepResponse(busy_seconds=0.125, host_seconds=0.0625, idle_seconds=1))
    assert not prefill.is_decode and decode.is_decode
    assert (totals.prefill_steps, totals.prefill_tokens, totals.decode_steps, totals.decode_tokens) == (1, 5, 2, 4)
    assert (totals.prefill_busy_seconds, totals.prefill_host_seconds) == (0.5, 0.25)
    assert (totals.decode_busy_seconds, totals.decode_host_seconds, totals.decode_idle_seconds) == (0.25, 0.125, 3)


def test_a_mixed_step_counts_as_prefill_with_its_decodes_beside():
    totals = Totals()
    a, b = _sequence(1, 3), _sequence(2, 6)
    a.num_blocks_on_workers, a.num_computed_tokens = 1, 3  # decoding its sampled token
    a.token_ids.append(7)
    mixed = StepPlan.build(1, [a, b], [1, 4], [])  # b's first chunk of 4
    totals.record_step(mixed, worker_pb2.StepResponse(busy_seconds=0.5, host_seconds=0.25))
    assert (mixed.is_decode, mixed.num_decodes, mixed.sample) == (False, 1, [True, False])
    assert (totals.prefill_steps, totals.prefill_tokens, totals.decode_steps, totals.decode_tokens) == (1, 4, 0, 0)
    assert (totals.mixed_steps, totals.mixed_decode_tokens, totals.prefill_busy_seconds) == (1, 1, 0.5)
