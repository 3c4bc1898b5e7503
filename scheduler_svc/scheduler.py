"""Continuous batching: which sequences compute what in the next step, and what its tokens do.

One token budget per step (max_num_batched_tokens). With chunked prefill (the default) a step is
mixed: every running sequence that has its prompt decodes one token first, then the prompts
part-way through continue, then waiting sequences are admitted while the running count, the
budget and the free blocks allow; a prompt longer than the budget left is split across steps
(and no chunk is longer than long_prefill_token_threshold, when set), so a long prompt never
stalls the decodes. Without chunked prefill a step either prefills whole prompts (only a prompt
longer than the whole budget is split) or, when nothing can be prefilled, decodes. When a decode
needs a new block and none is free, the most recently admitted sequence is preempted and later
recomputed.

Steps are pipelined: a step plan advances its sequences when it is built, so the next ones can
be scheduled while it runs, its sampled tokens pending. Call postprocess() for every plan, in
order; any number of plans may be unprocessed when schedule() is called. A pending token is
decoded by the workers from their own copy; a sequence that will reach its length limit with it
is not scheduled again, and one whose pending token turns out to stop it wastes one decode for
each further step already in flight.
"""
from collections import deque

from scheduler_svc.block_manager import Block, BlockManager
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.kv_event_log import KVEventLog
from scheduler_svc.publishing_block_manager import PublishingBlockManager
from scheduler_svc.sequence import Sequence, SequenceStatus
from scheduler_svc.step_plan import StepPlan


class AdmissionError(Exception):
    """A request that can never run; kind is "invalid" (bad input) or "exhausted" (too big for KV memory)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Scheduler:
    """Owns the waiting and running queues and the KV block pool of one worker group. The
    engine queues sequences (enqueue), asks for steps (schedule), returns each step's sampled
    tokens (postprocess) and cancels (abort); the scheduler decides who computes what and
    when a sequence finishes. It knows nothing of the wire: steps are plain StepPlans. With a
    KVEventLog, its prefix cache's changes are logged there as KV events."""

    def __init__(self, config: SchedulerConfig, kv_events: KVEventLog | None = None):
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must cover one "
                             f"decode token for each of max_num_seqs ({config.max_num_seqs}) sequences")
        if config.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold ({config.long_prefill_token_threshold}) must be "
                             "0 (off) or a positive token count")
        self.config = config
        self.kv_events = kv_events
        self.block_manager = self._block_manager(config.num_kv_blocks)
        # A sequence can never outgrow the pool either: past it, there is no slot for its next token.
        self.max_seq_len = min(config.max_model_len, config.num_kv_blocks * config.block_size)
        self.eos_token_ids = frozenset(config.eos_token_ids)
        # The most prompt tokens one sequence computes in a step (the budget caps them anyway).
        threshold = config.long_prefill_token_threshold if config.enable_chunked_prefill else 0
        self.max_chunk_tokens = threshold or config.max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.live: dict[int, Sequence] = {}  # waiting and running, by id
        # Sent with the next step; the workers drop these before computing its entries.
        self.forget_seq_ids: list[int] = []
        self.next_step_id = 1
        self.prefix_cache_hit_tokens = 0
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_total_blocks

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def enqueue(self, seq: Sequence) -> None:
        """Queues a sequence, or raises AdmissionError if it could never run."""
        num_tokens, limit = seq.num_prompt_tokens, self.config.max_model_len
        if num_tokens == 0:
            raise AdmissionError("invalid", "the prompt is empty")
        if num_tokens >= limit:
            raise AdmissionError("invalid", f"prompt has {num_tokens} tokens but the model's limit is "
                                            f"{limit} for prompt and completion together")
        num_blocks = self.block_manager.num_blocks_for(len(seq))  # a resumed one's tokens so far too
        if num_blocks > self.num_total_blocks:
            raise AdmissionError("exhausted", f"{'resumed sequence' if seq.completion_token_ids else 'prompt'} "
                                              f"needs {num_blocks} KV blocks of "
                                              f"{self.config.block_size} tokens but the pool has "
                                              f"{self.num_total_blocks}")
        self._set_limits(seq)
        self.waiting.append(seq)
        self.live[seq.seq_id] = seq

    def _set_limits(self, seq: Sequence) -> None:
        """What ends the sequence, as it checks every step: its length limit and its stop ids."""
        sampling = seq.sampling
        seq.length_limit = self.max_seq_len
        if sampling.max_tokens is not None:
            seq.length_limit = min(seq.length_limit, seq.num_prompt_tokens + sampling.max_tokens)
        seq.stop_ids = frozenset(sampling.stop_token_ids)
        if not sampling.ignore_eos or sampling.grammar:
            seq.stop_ids |= self.eos_token_ids

    def schedule(self) -> StepPlan | None:
        """The next step, or None when no sequence is live (pending forgets then ride on the next step)."""
        if self.config.enable_chunked_prefill:
            return self._schedule_mixed()
        return self._schedule_prefill() or self._schedule_decode()

    def postprocess(self, plan: StepPlan, token_ids: list[int]) -> list[Sequence]:
        """Applies a step's sampled tokens (one per entry with `sample` set, in entry order).

        Returns the sequences that received a token; finished ones have released their blocks.
        Tokens of sequences aborted or finished since the step was built are dropped.
        """
        if len(token_ids) != len(plan.sampled):
            raise ValueError(f"step {plan.step_id} sampled {len(plan.sampled)} sequences "
                             f"but {len(token_ids)} tokens came back")
        running, finished, block_size = SequenceStatus.RUNNING, SequenceStatus.FINISHED, self.config.block_size
        for seq, count, start in zip(plan.seqs, plan.num_tokens, plan.num_computed):
            seq.num_steps_in_flight -= 1
            if seq.status is running and (start + count) // block_size > start // block_size:  # rare in decode
                self.block_manager.cache_full_blocks(seq, start, start + count)
        served = []
        any_finished = False
        for seq, token_id in zip(plan.sampled, token_ids):
            if seq.status is finished:
                continue
            seq.num_pending_tokens -= 1
            seq.append_token(token_id)  # also when preempted meanwhile: it is recomputed with it
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                seq.finish_reason = reason
                if seq.status is SequenceStatus.WAITING:
                    self.waiting.remove(seq)
                self._release(seq)
                any_finished = True
            served.append(seq)
        if any_finished:
            self.running = [seq for seq in self.running if seq.status is running]
        return served

    def abort(self, seq_id: int) -> Sequence | None:
        """Cancels a live sequence wherever it is; None if it is not live."""
        seq = self.live.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._release(seq)
        return seq

    def _schedule_mixed(self) -> StepPlan | None:
        """Decodes first, then the prompts part-way through, then admissions, in one budget."""
        seqs, prefilling = self._claim_decode_slots()
        num_tokens = [1] * len(seqs)
        budget = self.config.max_num_batched_tokens - len(seqs)
        for seq in prefilling:
            if not budget:
                break
            seqs.append(seq)
            num_tokens.append(self._chunk(seq, budget))
            budget -= num_tokens[-1]
        self._admit_waiting(seqs, num_tokens, budget)
        return self._build(seqs, num_tokens) if seqs else None

    def drop_kv(self, num_blocks: int) -> list[Sequence]:
        """The workers lost their KV memory (a rank failed; the group restarts with `num_blocks`):
        forgets every block and prefix hash, and puts the running sequences back at the front of
        the waiting queue as preempted, to recompute prompt and tokens so far. Tokens of steps in
        flight are never post-processed: their plans are dropped. Returns the live sequences that
        no longer fit the new pool, finished (the caller ends their requests)."""
        self.block_manager = self._block_manager(num_blocks)
        if self.kv_events is not None:
            self.kv_events.cleared()
        self.max_seq_len = min(self.config.max_model_len, num_blocks * self.config.block_size)
        self.num_preemptions += len(self.running)
        self.waiting.extendleft(reversed(self.running))
        self.running, self.forget_seq_ids, self.next_step_id = [], [], 1
        too_long = []
        for seq in list(self.waiting):
            seq.status, seq.block_table = SequenceStatus.WAITING, []
            seq.num_computed_tokens = seq.num_blocks_on_workers = 0
            seq.num_pending_tokens = seq.num_steps_in_flight = 0
            self._set_limits(seq)
            if self.block_manager.num_blocks_for(len(seq)) > num_blocks:
                self.waiting.remove(seq)
                self._release(seq)
                too_long.append(seq)
        return too_long

    def _block_manager(self, num_blocks: int) -> BlockManager:
        config = self.config
        if self.kv_events is None:
            return BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        return PublishingBlockManager(num_blocks, config.block_size, config.enable_prefix_caching, self.kv_events)

    def _schedule_prefill(self) -> StepPlan | None:
        """Without chunked prefill: a step of prompts only, when any can be computed."""
        budget = self.config.max_num_batched_tokens
        seqs: list[Sequence] = []
        num_tokens: list[int] = []
        # At most one prompt is part-way through: the last one admitted, longer than the budget.
        # With one token left it simply joins the next decode.
        if self.running and self.running[-1].num_uncomputed_tokens > 1:
            seqs.append(self.running[-1])
            num_tokens.append(self._chunk(seqs[-1], budget))
            budget -= num_tokens[-1]
        self._admit_waiting(seqs, num_tokens, budget)
        return self._build(seqs, num_tokens) if seqs else None

    def _admit_waiting(self, seqs: list[Sequence], num_tokens: list[int], budget: int) -> None:
        """Admits waiting sequences into the step being built while the budget, the running count
        and the free blocks allow. Without chunked prefill only whole prompts join a step that
        computes something already (a prompt longer than the whole budget is split, alone)."""
        # A sequence preempted while a step of it is in flight waits for that step: its recompute
        # must include a token still pending, and the old step's post-processing must not touch
        # the blocks of its new admission.
        # A later completion of a request (n > 1) waits, in its place, for the first to compute the
        # prompt: it then takes the prompt's full blocks from the prefix cache.
        waiting, chunked = self.waiting, self.config.enable_chunked_prefill
        while (waiting and budget and len(self.running) < self.config.max_num_seqs
               and not waiting[0].num_steps_in_flight and not waiting[0].waits_for_leader):
            cached = [] if waiting[0].scores_prompt else self.block_manager.cached_prefix(waiting[0])
            if not chunked and seqs and len(waiting[0]) - len(cached) * self.config.block_size > budget:
                break
            if not self.block_manager.can_allocate(waiting[0], cached):
                break
            seqs.append(self._admit(waiting.popleft(), cached))
            num_tokens.append(self._chunk(seqs[-1], budget))
            budget -= num_tokens[-1]

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The prompt tokens a sequence computes in this step: what is left, within the budget and
        the long-prefill cap."""
        return min(seq.num_uncomputed_tokens, budget, self.max_chunk_tokens)

    def _admit(self, seq: Sequence, cached: list[Block]) -> Sequence:
        self.block_manager.allocate(seq, cached)
        seq.num_computed_tokens = len(cached) * self.config.block_size
        seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.prefix_cache_hit_tokens += seq.num_computed_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def _schedule_decode(self) -> StepPlan | None:
        """Without chunked prefill: a step in which every running sequence decodes."""
        decoding, _ = self._claim_decode_slots()
        return self._build(decoding, [1] * len(decoding)) if decoding else None

    def _claim_decode_slots(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences that decode in the next step, each with a slot for its token
        (preempting the most recently admitted ones when no block is free), and those part-way
        through their prompt, in admission order."""
        running, block_size = self.running, self.config.block_size
        # New lists: the plan must not change when running does (an abort while the step runs).
        # Preemption pops from the end of running, never a sequence already in either list.
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        index = 0
        while index < len(running):
            seq = running[index]
            computed = seq.num_computed_tokens
            known = len(seq.token_ids) + seq.num_pending_tokens
            if known - computed > 1:  # its prompt is not all computed
                prefilling.append(seq)
                index += 1
            elif known >= seq.length_limit:  # its pending token ends it: nothing to compute, no slot needed
                index += 1
            elif computed < len(seq.block_table) * block_size or self.block_manager.append_block(seq):
                decoding.append(seq)
                index += 1
            else:
                self._preempt(running.pop())  # may be seq itself, which ends the loop
        return decoding, prefilling

    def _build(self, seqs: list[Sequence], num_tokens: list[int]) -> StepPlan:
        plan = StepPlan.build(self.next_step_id, seqs, num_tokens, self.forget_seq_ids)
        self.next_step_id += 1
        self.forget_seq_ids = []
        return plan

    def _preempt(self, seq: Sequence) -> None:
        """Releases the sequence's blocks and queues it first, to be recomputed (prompt and
        completion so far, less what the prefix cache still holds)."""
        self.num_preemptions += 1
        self.block_manager.free(seq)
        self._forget(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self._forget(seq)
        seq.status = SequenceStatus.FINISHED
        del self.live[seq.seq_id]

    def _forget(self, seq: Sequence) -> None:
        if seq.num_blocks_on_workers:
            self.forget_seq_ids.append(seq.seq_id)
            seq.num_blocks_on_workers = 0

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        """Also records what stopped it (seq.stop_reason): a stop token id, not eos (as vLLM)."""
        if token_id in seq.stop_ids and len(seq.completion_token_ids) > seq.sampling.min_tokens:
            if token_id in seq.sampling.stop_token_ids:
                seq.stop_reason = token_id
            return "stop"
        if len(seq.token_ids) >= seq.length_limit:
            return "length"
        return None
