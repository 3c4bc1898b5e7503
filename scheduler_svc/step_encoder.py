"""The step plan on the wire: StepPlan -> worker_pb2.StepRequest. One pass over the dense
columns, then the few entries that reset or gain blocks."""
from nanoserve.v1 import llm_pb2, worker_pb2
from scheduler_svc.sequence import SamplingOptions
from scheduler_svc.step_plan import StepPlan


def encode_step(plan: StepPlan) -> worker_pb2.StepRequest:
    request = worker_pb2.StepRequest(step_id=plan.step_id, forget_seq_ids=plan.forget_seq_ids)
    add_entry = request.seqs.add
    for seq, start, num_token_ids, sample, num_generated in zip(plan.seqs, plan.num_computed, plan.num_token_ids,
                                                                plan.sample, plan.num_generated):
        # Fields left at their defaults are not passed: each keyword costs on the hot path (an empty
        # token list, a decode whose token is still in flight, costs as much as the rest of the entry).
        if num_token_ids:
            add_entry(seq_id=seq.seq_id, token_ids=seq.token_ids[start:start + num_token_ids], num_computed=start,
                      sample=sample, num_generated=num_generated)
        else:
            add_entry(seq_id=seq.seq_id, num_computed=start, sample=sample, num_generated=num_generated)
    entries = request.seqs
    for index, options in plan.resets.items():
        entry = entries[index]
        entry.reset = True
        entry.sampling.CopyFrom(encode_sampling(options))
        if options.has_penalties:  # the workers count the tokens the penalties look at
            seq = plan.seqs[index]
            entry.history_token_ids.extend(seq.token_ids[:seq.num_prompt_tokens + plan.num_generated[index]])
    for index, block_ids in plan.new_block_ids.items():
        entries[index].new_block_ids.extend(block_ids)
    for index, count in plan.scored.items():  # each position's target: the prompt token after it
        start = plan.num_computed[index] + 1
        entries[index].prompt_logprob_targets.extend(plan.seqs[index].token_ids[start:start + count])
    return request


# The options the workers apply beyond temperature: each goes on the wire only when a request
# changes it, so a plain request's reset entry is as small as it was before they existed (the
# workers read an unset field as its default, and skip every pass a sequence does not ask for).
_WORKER_OPTIONS = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "min_tokens", "logprobs", "prompt_logprobs")
_DEFAULTS = SamplingOptions()


def encode_sampling(options: SamplingOptions) -> llm_pb2.SamplingParams:
    """What the workers apply; the options the scheduler applies itself (stop strings, n) stay here."""
    params = llm_pb2.SamplingParams(temperature=options.temperature, max_tokens=options.max_tokens,
                                    ignore_eos=options.ignore_eos, seed=options.seed,
                                    stop_token_ids=options.stop_token_ids)
    for name in _WORKER_OPTIONS:
        value = getattr(options, name)
        if value != getattr(_DEFAULTS, name):
            setattr(params, name, value)
    if options.logit_bias:
        params.logit_bias.update(dict(options.logit_bias))
    return params
