"""One step as the scheduler plans it: per sequence, what the workers compute, as a delta
against what they already know. Plain lists, one entry per sequence in entry order; the
transport encodes them (step_encoder.py), post-processing reads them back."""
from dataclasses import dataclass

from scheduler_svc.sequence import Sequence


@dataclass(eq=False)
class StepPlan:
    """Columns of equal length, one row per entry; the sequences have already advanced past it."""
    step_id: int
    seqs: list[Sequence]                  # who each entry computes for (the encoder reads id and sampling)
    token_ids: list[tuple[int, ...]]      # tokens to compute; none for a decode of a token still in flight
    num_computed: list[int]               # tokens in the KV cache before this step: token_ids[0]'s position
    num_tokens: list[int]                 # tokens the entry computes, a token still in flight included
    new_block_ids: list[tuple[int, ...]]  # blocks appended since the workers last heard; all of them on reset
    reset: list[bool]                     # the workers do not know the sequence: start it afresh, sampling too
    sample: list[bool]                    # sample a token after this step
    num_generated: list[int]              # tokens generated so far, those still in flight included
    forget_seq_ids: list[int]             # sequences the workers drop before computing the entries
    sampled: list[Sequence]               # the entries that sample, in order: who receives the i-th token

    @property
    def is_decode(self) -> bool:
        """Every entry computes one token of a sequence the workers already know."""
        return all(count == 1 for count in self.num_tokens) and not any(self.reset)

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
        token_ids, num_computed, new_block_ids, reset, sample, num_generated, sampled = [], [], [], [], [], [], []
        for seq, count in zip(seqs, num_tokens):
            start = seq.num_computed_tokens
            end = start + count
            samples = end == len(seq.token_ids) + seq.num_pending_tokens
            # Tuples, not lists: holding only ints, they leave the garbage collector's view at its
            # next pass, so plans in flight do not push it into full collections over every sequence.
            token_ids.append(tuple(seq.token_ids[start:end]))
            num_computed.append(start)
            num_generated.append(seq.num_completion_tokens)
            known = seq.num_blocks_on_workers
            reset.append(known == 0)
            if known < len(seq.block_table):
                new_block_ids.append(tuple(seq.block_table[known:]))
                seq.num_blocks_on_workers = len(seq.block_table)
            else:
                new_block_ids.append(())
            seq.num_computed_tokens = end
            seq.num_steps_in_flight += 1
            sample.append(samples)
            if samples:
                seq.num_pending_tokens += 1
                sampled.append(seq)
        return cls(step_id, seqs, token_ids, num_computed, num_tokens, new_block_ids, reset, sample, num_generated,
                   forget_seq_ids, sampled)
