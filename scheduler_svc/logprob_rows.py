"""A step reply's log probabilities (worker.proto LogprobRows) back into one row per token, each
given to the sequence it belongs to. Rows come in entry order, each with its sequence's N
alternatives: the scheduler knows both from the step plan it sent."""
from typing import NamedTuple

from nanoserve.v1 import worker_pb2
from scheduler_svc.sequence import Sequence
from scheduler_svc.step_plan import StepPlan


class ScoredToken(NamedTuple):
    token_id: int
    logprob: float
    rank: int                       # 1 = the most likely token
    top: list[tuple[int, float]]    # the N most likely (token id, logprob), most likely first


def sampled_logprobs(plan: StepPlan, rows: worker_pb2.LogprobRows) -> dict[Sequence, ScoredToken]:
    """The sampled token's row of each sequence that asks for logprobs."""
    seqs = [seq for seq in plan.sampled if seq.sampling.logprobs is not None]
    return dict(zip(seqs, _split(rows, [seq.sampling.logprobs for seq in seqs])))


def prompt_logprobs(plan: StepPlan, rows: worker_pb2.LogprobRows) -> list[list[ScoredToken]]:
    """Each scored entry's rows (plan.scored order), one per prompt position it scored."""
    entries = [(plan.seqs[index].sampling.prompt_logprobs, count) for index, count in plan.scored.items()]
    flat = _split(rows, [num_top for num_top, count in entries for _ in range(count)])
    out, at = [], 0
    for _, count in entries:
        out.append(flat[at:at + count])
        at += count
    return out


def _split(rows: worker_pb2.LogprobRows, num_tops: list[int]) -> list[ScoredToken]:
    if len(rows.token_ids) != len(num_tops) or len(rows.top_token_ids) != sum(num_tops):
        raise ValueError(f"the workers sent {len(rows.token_ids)} logprob rows with {len(rows.top_token_ids)} "
                         f"alternatives; the step asked for {len(num_tops)} with {sum(num_tops)}")
    top_ids, top_logprobs = rows.top_token_ids, rows.top_logprobs
    out, at = [], 0
    for token_id, logprob, rank, num_top in zip(rows.token_ids, rows.logprobs, rows.ranks, num_tops):
        out.append(ScoredToken(token_id, logprob, rank, list(zip(top_ids[at:at + num_top],
                                                                  top_logprobs[at:at + num_top]))))
        at += num_top
    return out
