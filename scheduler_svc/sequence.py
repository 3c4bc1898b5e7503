"""One request's state as the scheduler tracks it, from admission to finish."""
from dataclasses import dataclass
from enum import Enum, auto

from nanoserve.wire import token_array


class SequenceStatus(Enum):
    WAITING = auto()   # queued: holds no blocks, the workers do not know it
    RUNNING = auto()   # admitted: holds blocks, prefilling or decoding
    FINISHED = auto()  # stopped, hit a length limit, or aborted


@dataclass(frozen=True)
class SamplingOptions:
    """A request's SamplingParams (llm.proto), checked, with their defaults filled in."""
    temperature: float = 1.0            # 0 = greedy
    max_tokens: int | None = None       # None: up to the model's length limit
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Applied by the workers (the scheduler only hands them on).
    top_p: float = 1.0
    top_k: int = 0                      # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0                 # the workers keep eos and stop tokens from being drawn before it
    # Applied here.
    stop: tuple[str, ...] = ()          # stop strings (matched on the streamed text)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None         # alternatives per generated token; None = no logprobs
    prompt_logprobs: int | None = None
    n: int = 1                          # completions of the prompt
    # structured_outputs as the grammar rank 0 enforces (scheduler_svc/structured_outputs.py); "" = none.
    # A constrained output ends at eos, ignore_eos or not: eos is all a complete grammar allows.
    grammar: str = ""

    @property
    def has_penalties(self) -> bool:
        """The workers need the sequence's token history (sent when they reset it)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class Sequence:
    __slots__ = ("seq_id", "sampling", "status", "prompt_token_ids", "completion_token_ids", "token_ids",
                 "block_table", "num_computed_tokens", "num_cached_prompt_tokens", "num_blocks_on_workers",
                 "num_pending_tokens", "num_steps_in_flight", "finish_reason", "stop_reason", "index", "leader",
                 "num_scored_prompt_tokens", "prompt_scoring_end", "length_limit", "stop_ids")

    def __init__(self, seq_id: int, prompt_token_ids: list[int], sampling: SamplingOptions, index: int = 0,
                 leader: "Sequence | None" = None):
        self.seq_id = seq_id
        # Completion `index` of its request; completions after the first have the first as their
        # leader and wait for it to compute the prompt, which they then take from the prefix cache.
        self.index = index
        self.leader = leader
        self.sampling = sampling
        self.status = SequenceStatus.WAITING
        self.prompt_token_ids = list(prompt_token_ids)
        self.completion_token_ids: list[int] = []
        # Prompt then completion: the history the KV cache covers. Kept whole beside the two
        # parts so that slicing it for blocks and steps never concatenates. Only ever appended
        # to: step plans refer to their tokens by position.
        self.token_ids = token_array(prompt_token_ids)  # uint32: blocks hash and steps pack it without a copy per id
        self.block_table: list[int] = []
        self.num_computed_tokens = 0         # while running: tokens whose KV the workers hold or are computing
        self.num_cached_prompt_tokens = 0    # prompt tokens the prefix cache served at the latest admission
        # Leading block_table entries the workers have been sent; 0 while they do not know
        # the sequence (not yet admitted, or preempted), so its next entry resets them.
        self.num_blocks_on_workers = 0
        # Tokens sampled by steps still in flight: they exist on the workers (which feed them into
        # the next decode themselves) but their values are not known here yet.
        self.num_pending_tokens = 0
        self.num_steps_in_flight = 0  # built steps with an entry for it that are not post-processed
        self.finish_reason: str | None = None  # "stop" or "length" once finished (None when aborted)
        self.stop_reason: int | str | None = None  # the stop token id or stop string that finished it
        # prompt_logprobs: the workers score prompt positions [0, prompt_scoring_end), each against
        # the token after it (0 without prompt_logprobs); those before num_scored_prompt_tokens
        # have been asked for already, so a recompute after preemption asks for none twice.
        self.prompt_scoring_end = len(prompt_token_ids) - 1 if sampling.prompt_logprobs is not None else 0
        self.num_scored_prompt_tokens = 0
        # Set by the scheduler when it queues the sequence (Scheduler.enqueue), so that the checks run
        # for every sequence every step are one comparison each: the length (prompt and completion)
        # at which it stops, and the token ids that may stop it (its stop ids, and eos unless ignored).
        self.length_limit = 0
        self.stop_ids: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def scores_prompt(self) -> bool:
        """Prompt positions remain to be scored: the prefix cache must not skip them."""
        return self.num_scored_prompt_tokens < self.prompt_scoring_end

    @property
    def waits_for_leader(self) -> bool:
        """Its leader's prompt is not computed yet (nor will be: it is not finished either)."""
        leader = self.leader
        return (leader is not None and not leader.completion_token_ids
                and leader.status is not SequenceStatus.FINISHED)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.completion_token_ids.append(token_id)
