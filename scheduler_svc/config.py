"""Scheduler limits: batch sizes, token budget, KV pool shape. No torch here, ever."""
from dataclasses import dataclass

from nanoserve.flags import defaults

_DEFAULT = defaults("scheduler")  # the defaults of the fields that are flags


@dataclass
class SchedulerConfig:
    num_kv_blocks: int                      # agreed with the workers (their smallest count)
    block_size: int                         # tokens per block, as the workers report it
    max_model_len: int                      # prompt + generated tokens of one sequence
    eos_token_ids: tuple[int, ...] = ()
    max_num_seqs: int = _DEFAULT["max_num_seqs"]                      # running sequences at once
    max_num_batched_tokens: int = _DEFAULT["max_num_batched_tokens"]  # tokens computed in one step
    enable_prefix_caching: bool = _DEFAULT["enable_prefix_caching"]
    # Steps mix decodes with prompt chunks; off: a step either prefills whole prompts or decodes.
    enable_chunked_prefill: bool = _DEFAULT["enable_chunked_prefill"]
    long_prefill_token_threshold: int = _DEFAULT["long_prefill_token_threshold"]  # chunk cap; 0 = none
