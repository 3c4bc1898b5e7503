"""One step as the workers receive it, in delta form, plus what post-processing needs."""
from dataclasses import dataclass

from nanoserve.v1 import worker_pb2
from scheduler_svc.sequence import Sequence


@dataclass
class StepBatch:
    request: worker_pb2.StepRequest
    seqs: list[Sequence]      # one per entry, in entry order
    num_tokens: list[int]     # tokens each entry computes
    sampled: list[Sequence]   # the entries with `sample` set: who receives token_ids[i]

    @property
    def is_decode(self) -> bool:
        """Every entry computes one token of a sequence the workers already know."""
        return all(count == 1 for count in self.num_tokens) and not any(e.reset for e in self.request.seqs)

    @classmethod
    def build(cls, step_id: int, seqs: list[Sequence], num_tokens: list[int],
              forget_seq_ids: list[int]) -> "StepBatch":
        """Describes each sequence against what the workers already know of it, and records
        what they will know after this step. A sequence they do not know gets its whole block
        table and sampling options; afterwards only the tokens to compute and the blocks
        appended since, so a decode entry stays the same size whatever the context length.
        A decode of a token still in flight sends no token: the workers feed in their own.

        The sequences advance at once (computed tokens, and a pending token for each entry that
        samples), so the next step can be scheduled before this one's tokens come back."""
        request = worker_pb2.StepRequest(step_id=step_id, forget_seq_ids=forget_seq_ids)
        add_entry = request.seqs.add
        sampled = []
        for seq, count in zip(seqs, num_tokens):
            start = seq.num_computed_tokens
            end = start + count
            sample = end == len(seq.token_ids) + seq.num_pending_tokens
            # Fields left at their defaults are not passed: each keyword costs on the hot path.
            entry = add_entry(seq_id=seq.seq_id, token_ids=seq.token_ids[start:end], num_computed=start,
                              sample=sample, num_generated=seq.num_completion_tokens)
            if seq.num_blocks_on_workers == 0:
                entry.reset = True
                entry.sampling.CopyFrom(seq.sampling.to_proto())
            if seq.num_blocks_on_workers < len(seq.block_table):
                entry.new_block_ids.extend(seq.block_table[seq.num_blocks_on_workers:])
                seq.num_blocks_on_workers = len(seq.block_table)
            seq.num_computed_tokens = end
            seq.num_steps_in_flight += 1
            if sample:
                seq.num_pending_tokens += 1
                sampled.append(seq)
        return cls(request, seqs, num_tokens, sampled)
