"""Grammar-constrained sampling on the sampling rank: per slot of the sequence table, the llguidance
matcher of a constrained sequence, beside the penalty state SamplingExtras keeps, so no mask ever
crosses the wire.

Each constrained slot's next mask is filled ahead, into a per-slot table in pinned host memory, by
one mask thread that takes its jobs in order: the first masks of a step's new sequences, once their
matchers exist, and after each step the rows that step drew: the thread waits for the step's
tokens to come home, the matchers consume them and fill their next masks (both on llguidance's own
threads). A step that samples constrained rows waits for the jobs queued before it, copies the
table's rows it needs to the device's copy of the table and masks the logits in one launch (each
logits row reads its slot's row) before every other logits processor: the launcher thread does none
of the grammar work and gathers nothing, so it builds and queues the step's forward pass while the
masks are filled, and the fill starts the moment the tokens it needs are home. Only steps that
sample constrained rows wait for the previous step's tokens; the others (prefills and resets
included) keep the pipeline as deep as it is. mask_timings.py splits the time per step.

A grammar is compiled once per text (a template matcher, cached; each sequence takes a copy) on a
thread of its own, off the step loop. A reset also replays the generated tokens the scheduler sends,
so a recomputed sequence (preemption, a worker restart) resumes its
grammar where it was."""
import functools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import consume_token_par, fill_next_token_bitmask, fill_next_token_bitmask_par

from nanoserve.grammar_tokenizer import GrammarTokenizer
from nanoserve_kernels.token_bitmask import apply_token_bitmask, bitmask_words
from nanoserve_model.logits_processors import upload
from worker_svc.mask_timings import MaskTimings

log = logging.getLogger("nanoserve.worker")

# Distinct grammars whose compiled template is kept.
TEMPLATE_CACHE_SIZE = 256
# llguidance's threads consuming a step's tokens and filling its masks. Inside a JSON string a row's
# consume takes ~1 us and its mask ~3 us (its first one in the string ~0.5 ms): 256 rows take ~1 ms on
# one core of the busy 2-core development machine, so a few threads do; every further thread is one more
# that a busy host may deschedule in the middle of a step's rows, holding up the whole step.
MASK_THREADS = max(1, min(4, (os.cpu_count() or 2) // 4))
# A step with at most this many constrained rows has its matchers advanced on the launcher thread, when
# the next masked step needs them: a row takes ~10 us, while handing the work to the mask thread and
# back takes the GIL three times more per step, each a switch on the launcher's critical path (batch-1
# decode is bound by the launcher's Python).
INLINE_ROWS = 4


class GrammarMasks:
    def __init__(self, capacity: int, tokenizer: GrammarTokenizer, device: torch.device):
        self.tokenizer, self.device = tokenizer, device
        self.words = bitmask_words(tokenizer.vocab_size)
        self.matchers: list[Future | None] = [None] * capacity  # per slot; its result an LLMatcher, or None
        self.constrained = np.zeros(capacity, bool)  # per slot: holds a matcher
        self.num_constrained = 0  # slots holding a matcher: while 0, no batch is looked at
        pinned = device.type == "cuda"
        # Per slot: the mask of its matcher's next token, kept current by the mask thread's jobs; pinned,
        # so a step's rows go to the device straight from here, with no per-step buffer.
        self.host_table = torch.zeros((capacity, self.words), dtype=torch.int32, pin_memory=pinned)
        self.next_masks = self.host_table.numpy()
        self.device_table = self.host_table.to(device) if pinned else self.host_table
        # A large step's rows (up to 19 KB each) go over on a stream of their own, beside the forward pass
        # still running, rather than after it on the step's stream.
        self.copy_stream = torch.cuda.Stream(device) if pinned else None
        self.new_sequences: list[tuple[int, Future]] = []  # this step's resets, their first masks not yet asked for
        self.jobs: list[Future] = []  # the mask thread's jobs since the last masked step
        self.inline_advance: tuple | None = None  # a small step's advance, left to the next masked step
        self.device_rows: torch.Tensor | None = None  # the masked rows of the current step; None: all of them
        self.compiler = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self.mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")  # one: jobs keep their order
        self.executor: LLExecutor | None = None
        self.template = functools.lru_cache(TEMPLATE_CACHE_SIZE)(self._template)
        self.timings = MaskTimings()
        self._apply = apply_token_bitmask
        if device.type == "cuda":
            from nanoserve_kernels.triton_token_bitmask import apply_token_bitmask as apply_on_gpu
            self._apply = apply_on_gpu

    def reset(self, slot: int, grammar: str, generated: list[int]) -> None:
        """A new sequence in `slot`, constrained by `grammar` ("" = not constrained), which has
        already drawn `generated`. Its first mask is asked for by fill_first_masks()."""
        self.num_constrained += bool(grammar) - bool(self.constrained[slot])
        self.constrained[slot] = bool(grammar)
        self.matchers[slot] = self.compiler.submit(self._start, grammar, generated) if grammar else None
        if grammar:
            self.new_sequences.append((slot, self.matchers[slot]))

    def fill_first_masks(self) -> None:
        """After a step's resets: the mask thread fills their first masks together, once their
        matchers exist."""
        if self.new_sequences:
            self.jobs.append(self.mask_thread.submit(self._fill_first, self.new_sequences))
            self.new_sequences = []

    def _template(self, grammar: str) -> LLMatcher:
        return LLMatcher(self.tokenizer.get(), grammar)

    def _start(self, grammar: str, generated: list[int]) -> LLMatcher | None:
        try:
            matcher = self.template(grammar).deep_copy()
        except Exception as err:  # no tokenizer file: the sequence can only end
            log.error("cannot compile a grammar: %s", err)
            return None
        if not matcher.consume_tokens(generated) and not matcher.is_stopped():
            log.warning("a resumed sequence's tokens do not follow its grammar: %s", matcher.get_error())
        return matcher

    def _fill_first(self, new_sequences: list[tuple[int, Future]]) -> None:
        """On the mask thread: new sequences' first masks (a grammar that failed to compile allows only
        eos: the sequence can only end)."""
        started = time.perf_counter()
        live = []
        for slot, matcher in new_sequences:
            if matcher.result() is not None:
                live.append((matcher.result(), slot))
                continue
            self.next_masks[slot] = 0
            for eos in self.tokenizer.eos_token_ids:
                self.next_masks.view(np.uint32)[slot, eos // 32] |= np.uint32(1 << (eos % 32))
        self._fill(live)
        self.timings.add(first=time.perf_counter() - started)

    def _fill(self, live: list[tuple[LLMatcher, int]]) -> None:
        """Each matcher's next mask into its slot's row: on llguidance's threads, one row here (handing
        it over costs more)."""
        if len(live) == 1:
            fill_next_token_bitmask(live[0][0], self.next_masks, live[0][1])
        elif live:
            fill_next_token_bitmask_par(self._executor(), live, self.next_masks)

    def constrained_rows(self, slots: np.ndarray) -> np.ndarray:
        """Positions in `slots` (a step's sampled slots) of constrained sequences."""
        if not self.num_constrained:
            return np.zeros(0, np.int64)
        return np.flatnonzero(self.constrained[slots])

    def mask(self, logits: torch.Tensor, slots: np.ndarray, rows: np.ndarray, device_slots: torch.Tensor) -> None:
        """Masks, in place, the logits rows `rows` (constrained_rows of `slots`, the step's sampled
        slots, which `device_slots` holds on the device) by their grammars."""
        started = time.perf_counter()
        for job in self.jobs:  # each, so that any job's error surfaces here
            job.result()
        self.jobs.clear()
        waited = time.perf_counter()
        if self.inline_advance is not None:  # after the jobs: a reset slot's first mask is filled by then
            self._advance(*self.inline_advance)
            self.inline_advance = None
        advanced = time.perf_counter()
        if self.copy_stream is not None:
            self._copy_rows(slots[rows])
        self.device_rows = None if len(rows) == len(logits) else upload(rows, self.device)
        mask_rows = device_slots if self.device_rows is None else device_slots[self.device_rows]
        self._apply(logits, self.device_table, mask_rows, self.device_rows)
        self.timings.masked_step(len(rows), launcher_wait=waited - started, queue=time.perf_counter() - advanced)

    def _copy_rows(self, masked_slots: np.ndarray) -> None:
        """The table's rows from the step's first to its last masked slot, to the device's table. The
        last masked step's kernel has read the device's table by now: its tokens, drawn after it, are home."""
        first, end = int(masked_slots.min()), int(masked_slots.max()) + 1
        if len(masked_slots) <= INLINE_ROWS:
            self.device_table[first:end].copy_(self.host_table[first:end], non_blocking=True)
            return
        with torch.cuda.stream(self.copy_stream):
            self.device_table[first:end].copy_(self.host_table[first:end], non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def unmasked_step(self) -> None:
        """A sampled step with no constrained row: a run of masked steps, if any, has ended."""
        self.timings.log_run(log)

    def warm_up(self, logits: torch.Tensor) -> None:
        """Runs the mask kernel in both its variants (some rows, every row) with masks that keep every
        token, so that it compiles at start-up, never while serving."""
        allow_all = torch.full((len(logits), self.words), -1, dtype=torch.int32, device=logits.device)
        every = torch.arange(len(logits), device=logits.device)
        self._apply(logits, allow_all, every, every)
        self._apply(logits, allow_all, every, None)

    def observe(self, drawn: torch.Tensor, event: torch.cuda.Event | None, slots: np.ndarray, rows: np.ndarray) -> None:
        """The step's drawn tokens on their way home (`drawn`, one per sampled slot, in host memory
        once `event` has passed; None: already there): the mask thread advances the masked rows'
        matchers by them and fills their next masks (a small step's: the launcher thread, at the next
        masked step)."""
        masked = slots[rows].tolist()
        positions = None if self.device_rows is None else rows.tolist()
        advance = ([self.matchers[slot] for slot in masked], masked, drawn, positions, event)
        if len(masked) <= INLINE_ROWS:
            self.inline_advance = advance
        else:
            self.jobs.append(self.mask_thread.submit(self._advance, *advance))

    def _advance(self, matchers: list[Future], slots: list[int], drawn: torch.Tensor, positions: list[int] | None,
                 event: torch.cuda.Event | None) -> None:
        """Once a step's tokens are home, its matchers consume them and fill their next masks, both on
        llguidance's threads (one row: here, as handing it over costs more). A slot handed to another
        sequence since is left alone: the old one is gone, and the new one's first mask is its own job's."""
        started = time.perf_counter()
        if event is not None:
            event.synchronize()
        home = time.perf_counter()
        tokens = drawn.tolist()
        tokens = tokens if positions is None else [tokens[i] for i in positions]
        # a refused token leaves its matcher in error: it then allows only eos
        live = [(future.result(), token, slot) for future, token, slot in zip(matchers, tokens, slots)
                if future is self.matchers[slot]]
        live = [entry for entry in live if entry[0] is not None]
        if len(live) == 1:
            live[0][0].consume_token(live[0][1])
        elif live:
            consume_token_par(self._executor(), [(matcher, token) for matcher, token, _ in live])
        consumed = time.perf_counter()
        self._fill([(matcher, slot) for matcher, _, slot in live])
        self.timings.add(tokens_wait=home - started, consume=consumed - home, fill=time.perf_counter() - consumed)

    def _executor(self) -> LLExecutor:
        if self.executor is None:
            self.executor = LLExecutor(MASK_THREADS)
        return self.executor
