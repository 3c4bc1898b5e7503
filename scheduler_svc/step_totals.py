"""The engine's counters behind GetStats and /metrics."""
from dataclasses import dataclass

from nanoserve.v1 import worker_pb2
from scheduler_svc.step_plan import StepPlan


@dataclass
class Totals:
    """Counters behind GetStats; step timings are rank 0's own."""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    requests_finished: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_busy_seconds: float = 0.0
    decode_busy_seconds: float = 0.0
    decode_idle_seconds: float = 0.0
    prefill_host_seconds: float = 0.0
    decode_host_seconds: float = 0.0
    mixed_steps: int = 0
    mixed_decode_tokens: int = 0

    def record_step(self, plan: StepPlan, reply: worker_pb2.StepResponse) -> None:
        """A step that computes prompt tokens counts as a prefill step, a mixed one too (its decodes
        are counted beside it)."""
        if not plan.seqs:
            return
        if plan.is_decode:
            self.decode_steps += 1
            self.decode_tokens += len(plan.seqs)
            self.decode_busy_seconds += reply.busy_seconds
            self.decode_idle_seconds += reply.idle_seconds
            self.decode_host_seconds += reply.host_seconds
        else:
            num_decodes = plan.num_decodes
            self.prefill_steps += 1
            self.prefill_tokens += sum(plan.num_tokens) - num_decodes
            self.prefill_busy_seconds += reply.busy_seconds
            self.prefill_host_seconds += reply.host_seconds
            if num_decodes:
                self.mixed_steps += 1
                self.mixed_decode_tokens += num_decodes
