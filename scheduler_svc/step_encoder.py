"""The step plan on the wire: StepPlan -> worker_pb2.StepRequest. The plan's dense columns go over
as they are, each in one call; the few entries that reset, gain blocks or score their prompt add
an EntryExtras each."""
from nanoserve.v1 import llm_pb2, worker_pb2
from nanoserve.wire import pack_token_ids, token_array
from scheduler_svc.sequence import SamplingOptions
from scheduler_svc.step_plan import StepPlan


def encode_step(plan: StepPlan) -> worker_pb2.StepRequest:
    token_ids = token_array()
    extend = token_ids.extend
    for seq, start, count in zip(plan.seqs, plan.num_computed, plan.num_token_ids):
        if count:  # most decodes send none: the workers feed in the token they sampled
            extend(seq.token_ids[start:start + count])
    request = worker_pb2.StepRequest(
        step_id=plan.step_id, forget_seq_ids=plan.forget_seq_ids, seq_ids=[seq.seq_id for seq in plan.seqs],
        num_computed=plan.num_computed, num_token_ids=plan.num_token_ids, token_ids=pack_token_ids(token_ids),
        sample=plan.sample, num_generated=plan.num_generated)
    for index in sorted(plan.resets.keys() | plan.new_block_ids.keys() | plan.scored.keys()):
        extras = request.extras.add(entry=index, new_block_ids=plan.new_block_ids.get(index, ()))
        options = plan.resets.get(index)
        if options is not None:
            extras.reset = True
            extras.sampling.CopyFrom(encode_sampling(options))
            # The workers count the tokens the penalties look at, and move a grammar past the generated ones.
            if options.has_penalties or options.grammar:
                seq = plan.seqs[index]
                extras.history_token_ids.extend(seq.token_ids[:seq.num_prompt_tokens + plan.num_generated[index]])
            extras.grammar = options.grammar
        count = plan.scored.get(index)
        if count:  # each position's target: the prompt token after it
            start = plan.num_computed[index] + 1
            extras.prompt_logprob_targets.extend(plan.seqs[index].token_ids[start:start + count])
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
