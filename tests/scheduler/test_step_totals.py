"""GetStats' step counters (engine.Totals): each step's rank-0 timings are added to its kind."""
from nanoserve.v1 import worker_pb2
from scheduler_svc.engine import Totals
from scheduler_svc.step_batch import StepBatch


def test_step_timings_add_up_by_kind():
    totals = Totals()
    prefill = StepBatch(worker_pb2.StepRequest(seqs=[worker_pb2.SeqStep(reset=True)]), [object()], [5], [])
    decode = StepBatch(worker_pb2.StepRequest(seqs=[worker_pb2.SeqStep(), worker_pb2.SeqStep()]),
                       [object(), object()], [1, 1], [])
    totals.record_step(prefill, worker_pb2.StepResponse(busy_seconds=0.5, host_seconds=0.25, idle_seconds=9))
    totals.record_step(decode, worker_pb2.StepResponse(busy_seconds=0.125, host_seconds=0.0625, idle_seconds=2))
    totals.record_step(decode, worker_pb2.StepResponse(busy_seconds=0.125, host_seconds=0.0625, idle_seconds=1))
    assert (totals.prefill_steps, totals.prefill_tokens, totals.decode_steps, totals.decode_tokens) == (1, 5, 2, 4)
    assert (totals.prefill_busy_seconds, totals.prefill_host_seconds) == (0.5, 0.25)
    assert (totals.decode_busy_seconds, totals.decode_host_seconds, totals.decode_idle_seconds) == (0.25, 0.125, 3)
