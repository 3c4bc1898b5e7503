"""One request's state as the scheduler tracks it, from admission to finish."""
from dataclasses import dataclass
from enum import Enum, auto


class SequenceStatus(Enum):
    WAITING = auto()   # queued: holds no blocks, the workers do not know it
    RUNNING = auto()   # admitted: holds blocks, prefilling or decoding
    FINISHED = auto()  # stopped, hit a length limit, or aborted


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 1.0            # 0 = greedy
    max_tokens: int | None = None       # None: up to the model's length limit
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


class Sequence:
    __slots__ = ("seq_id", "sampling", "status", "prompt_token_ids", "completion_token_ids", "token_ids",
                 "block_table", "num_computed_tokens", "num_cached_prompt_tokens", "num_blocks_on_workers",
                 "num_pending_tokens", "num_steps_in_flight", "finish_reason")

    def __init__(self, seq_id: int, prompt_token_ids: list[int], sampling: SamplingOptions):
        self.seq_id = seq_id
        self.sampling = sampling
        self.status = SequenceStatus.WAITING
        self.prompt_token_ids = list(prompt_token_ids)
        self.completion_token_ids: list[int] = []
        # Prompt then completion: the history the KV cache covers. Kept whole beside the two
        # parts so that slicing it for blocks and steps never concatenates. Only ever appended
        # to: step plans refer to their tokens by position.
        self.token_ids = list(prompt_token_ids)
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

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def num_completion_tokens(self) -> int:
        """Generated so far, counting the tokens still in flight."""
        return len(self.completion_token_ids) + self.num_pending_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.completion_token_ids.append(token_id)
