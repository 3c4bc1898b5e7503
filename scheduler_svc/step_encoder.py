"""The step plan on the wire: StepPlan -> worker_pb2.StepRequest, in one pass over its lists."""
from nanoserve.v1 import llm_pb2, worker_pb2
from scheduler_svc.sequence import SamplingOptions
from scheduler_svc.step_plan import StepPlan


def encode_step(plan: StepPlan) -> worker_pb2.StepRequest:
    request = worker_pb2.StepRequest(step_id=plan.step_id, forget_seq_ids=plan.forget_seq_ids)
    add_entry = request.seqs.add
    for seq, token_ids, num_computed, new_block_ids, reset, sample, num_generated in zip(
            plan.seqs, plan.token_ids, plan.num_computed, plan.new_block_ids, plan.reset, plan.sample,
            plan.num_generated):
        # Fields left at their defaults are not passed: each keyword costs on the hot path.
        entry = add_entry(seq_id=seq.seq_id, token_ids=token_ids, num_computed=num_computed, sample=sample,
                          num_generated=num_generated)
        if new_block_ids:
            entry.new_block_ids.extend(new_block_ids)
        if reset:
            entry.reset = True
            entry.sampling.CopyFrom(encode_sampling(seq.sampling))
    return request


def encode_sampling(options: SamplingOptions) -> llm_pb2.SamplingParams:
    return llm_pb2.SamplingParams(temperature=options.temperature, max_tokens=options.max_tokens,
                                  ignore_eos=options.ignore_eos, seed=options.seed,
                                  stop_token_ids=options.stop_token_ids)
