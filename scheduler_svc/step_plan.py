"""One step as the scheduler plans it: per sequence, what the workers compute, as a delta
against what they already know. Plain lists and dicts, no wire format: the transport encodes
a plan (step_encoder.py), post-processing reads it back.

Built for the decode hot path. Every entry has a row in the dense columns; the fields only a
few entries need (a reset, new blocks) are keyed by entry index. An entry's token ids are not
copied: they are seq.token_ids[num_computed:][:num_token_ids], a slice that cannot change since
a sequence's token list only grows, and the encoder takes it straight into the message. So a
prompt is copied once, and a plan in flight holds nothing per decode entry that the garbage
collector must track (small lists living across steps would drive it into full collections
over every sequence's tokens).
"""
from dataclasses import dataclass

from scheduler_svc.sequence import SamplingOptions, Sequence


@dataclass(eq=False)
class StepPlan:
    step_id: int
    # Dense: one row per entry, in entry order.
    seqs: list[Sequence]           # who each entry computes for (the encoder reads its id)
    num_computed: list[int]        # tokens in the KV cache before this step: the first one's position
    num_token_ids: list[int]       # token ids sent: 0 for a decode of a token still in flight
    num_tokens: list[int]          # tokens the entry computes, a token still in flight included
    sample: list[bool]             # sample a token after this step
    num_generated: list[int]       # tokens generated so far, those still in flight included
    # Sparse, by entry index.
    resets: dict[int, SamplingOptions]    # sequences the workers do not know: start afresh with these options
    new_block_ids: dict[int, tuple[int, ...]]  # blocks appended since the workers last heard (all on a reset)
    forget_seq_ids: list[int]      # sequences the workers drop before computing the entries
    sampled: list[Sequence]        # the entries that sample, in order: who receives the i-th token
    scored: dict[int, int]         # prompt_logprobs: positions the workers score, from the entry's first

    @property
    def is_decode(self) -> bool:
        """Every entry computes one token of a sequence the workers already know."""
        return not self.resets and all(count == 1 for count in self.num_tokens)

    @property
    def num_decodes(self) -> int:
        """The leading entries that decode: one token of a sequence the workers know. A mixed step
        puts every decode ahead of its prompt chunks (and a prefill step has none)."""
        for index, count in enumerate(self.num_tokens):
            if count != 1 or index in self.resets:
                return index
        return len(self.num_tokens)

    @classmethod
    def build(cls, step_id: int, seqs: list[Sequence], num_tokens: list[int],
              forget_seq_ids: list[int]) -> "StepPlan":
        """Describes each sequence against what the workers already know of it, and records
        what they will know after this step. A sequence they do not know gets its whole block
        table and sampling options; afterwards only the tokens to compute and the blocks
        appended since, so a decode entry stays the same size whatever the context length.
        A decode of a token still in flight sends no token: the workers feed in their own.

        The sequences advance at once (computed tokens, and a pending token for each entry that
        samples), so the next step can be scheduled before this one's tokens come back."""
        num_computed, num_token_ids, sample, num_generated, sampled = [], [], [], [], []
        resets: dict[int, SamplingOptions] = {}
        new_block_ids: dict[int, tuple[int, ...]] = {}
        scored: dict[int, int] = {}
        for index, (seq, count) in enumerate(zip(seqs, num_tokens)):
            start = seq.num_computed_tokens
            end = start + count
            num_known, num_pending = len(seq.token_ids), seq.num_pending_tokens
            num_computed.append(start)
            num_token_ids.append(count if end <= num_known else max(0, num_known - start))  # in flight: none
            num_generated.append(len(seq.completion_token_ids) + num_pending)
            num_sent_blocks = seq.num_blocks_on_workers
            if num_sent_blocks < len(seq.block_table):  # rare in decode: once a block
                if not num_sent_blocks:
                    resets[index] = seq.sampling
                new_block_ids[index] = tuple(seq.block_table[num_sent_blocks:])
                seq.num_blocks_on_workers = len(seq.block_table)
            if seq.num_scored_prompt_tokens < seq.prompt_scoring_end and start < seq.prompt_scoring_end:
                scored[index] = min(end, seq.prompt_scoring_end) - start
                seq.num_scored_prompt_tokens = max(seq.num_scored_prompt_tokens, start + scored[index])
            seq.num_computed_tokens = end
            seq.num_steps_in_flight += 1
            samples = end == num_known + num_pending
            sample.append(samples)
            if samples:
                seq.num_pending_tokens = num_pending + 1
                sampled.append(seq)
        return cls(step_id, seqs, num_computed, num_token_ids, num_tokens, sample, num_generated, resets,
                   new_block_ids, forget_seq_ids, sampled, scored)
