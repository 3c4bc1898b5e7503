"""Grammar-constrained sampling on the sampling rank: per slot of the sequence table, the llguidance
matcher of a constrained sequence, beside the penalty state SamplingExtras keeps, so no mask ever
crosses the wire.

Each constrained slot's next mask is filled ahead, into a host table, by one mask thread that takes its
jobs in order: a reset's first mask, once its matcher exists, and after each step the rows that
step drew: the thread waits for the step's tokens to come home, the matchers consume them and fill
their next masks (both on llguidance's own threads). A step that samples constrained rows waits for
the jobs queued before it, gathers its rows from the table and masks the logits in one launch before
every other logits processor: the launcher thread does none of the grammar work, so it builds and
queues the step's forward pass while the masks are filled, and the fill starts the moment the
tokens it needs are home. Only steps that sample constrained rows wait for the previous step's
tokens; the others (prefills and resets included) keep the pipeline as deep as it is.

A grammar is compiled once per text (a template matcher, cached; each sequence takes a copy) on a
thread of its own, off the step loop. A reset also replays the generated tokens the scheduler sends,
so a recomputed sequence (preemption, a worker restart) resumes its
grammar where it was."""
import functools
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import consume_token_par, fill_next_token_bitmask, fill_next_token_bitmask_par

from nanoserve.grammar_tokenizer import GrammarTokenizer
from nanoserve_kernels.token_bitmask import apply_token_bitmask, bitmask_words
from nanoserve_model.logits_processors import upload

log = logging.getLogger("nanoserve.worker")

# Distinct grammars whose compiled template is kept.
TEMPLATE_CACHE_SIZE = 256
# llguidance's threads filling a step's masks and consuming its tokens, a row each at a time (~40 us a row of a JSON schema on a
# busy 2-core machine): half the cores, at most 8, leaving the rest to the step loop, the reply thread
# and the scheduler (llguidance's default takes 80% of them).
MASK_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


class GrammarMasks:
    def __init__(self, capacity: int, tokenizer: GrammarTokenizer, device: torch.device):
        self.tokenizer, self.device = tokenizer, device
        self.words = bitmask_words(tokenizer.vocab_size)
        self.matchers: list[Future | None] = [None] * capacity  # per slot; its result an LLMatcher, or None
        self.constrained = np.zeros(capacity, bool)  # per slot: holds a matcher
        self.num_constrained = 0  # slots holding a matcher: while 0, no batch is looked at
        # Per slot: the mask of its matcher's next token, kept current by the mask thread's jobs.
        self.next_masks = np.zeros((capacity, self.words), np.int32)
        self.jobs: list[Future] = []  # the mask thread's jobs since the last masked step
        self.device_rows: torch.Tensor | None = None  # the masked rows of the current step; None: all of them
        self.compiler = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self.mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")  # one: jobs keep their order
        self.executor: LLExecutor | None = None
        self.template = functools.lru_cache(TEMPLATE_CACHE_SIZE)(self._template)
        self._apply = apply_token_bitmask
        if device.type == "cuda":
            from nanoserve_kernels.triton_token_bitmask import apply_token_bitmask as apply_on_gpu
            self._apply = apply_on_gpu

    def reset(self, slot: int, grammar: str, generated: list[int]) -> None:
        """A new sequence in `slot`, constrained by `grammar` ("" = not constrained), which has
        already drawn `generated`."""
        self.num_constrained += bool(grammar) - bool(self.constrained[slot])
        self.constrained[slot] = bool(grammar)
        self.matchers[slot] = self.compiler.submit(self._start, grammar, generated) if grammar else None
        if grammar:
            self.jobs.append(self.mask_thread.submit(self._fill_first, slot, self.matchers[slot]))

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

    def _fill_first(self, slot: int, matcher: Future) -> None:
        """On the mask thread: a new sequence's first mask, once its matcher exists (a grammar that
        failed to compile allows only eos: the sequence can only end)."""
        if matcher.result() is not None:
            fill_next_token_bitmask(matcher.result(), self.next_masks, slot)
            return
        self.next_masks[slot] = 0
        for eos in self.tokenizer.eos_token_ids:
            self.next_masks.view(np.uint32)[slot, eos // 32] |= np.uint32(1 << (eos % 32))

    def constrained_rows(self, slots: np.ndarray) -> np.ndarray:
        """Positions in `slots` (a step's sampled slots) of constrained sequences."""
        if not self.num_constrained:
            return np.zeros(0, np.int64)
        return np.flatnonzero(self.constrained[slots])

    def mask(self, logits: torch.Tensor, slots: np.ndarray, rows: np.ndarray) -> None:
        """Masks, in place, the logits rows `rows` (constrained_rows of `slots`) by their grammars."""
        for job in self.jobs:  # each, so that any job's error surfaces here
            job.result()
        self.jobs.clear()
        # Gathered where the copy to the device starts from (pinned on CUDA: the caching host allocator
        # hands the block out again only once its copy is done).
        pinned = torch.empty((len(rows), self.words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        np.take(self.next_masks, slots[rows], axis=0, out=pinned.numpy())
        self.device_rows = None if len(rows) == len(logits) else upload(rows, self.device)
        self._apply(logits, pinned.to(self.device, non_blocking=True), self.device_rows)

    def warm_up(self, logits: torch.Tensor) -> None:
        """Runs the mask kernel in both its variants (some rows, every row) with masks that keep every
        token, so that it compiles at start-up, never while serving."""
        allow_all = torch.full((len(logits), self.words), -1, dtype=torch.int32, device=logits.device)
        self._apply(logits, allow_all, torch.arange(len(logits), device=logits.device))
        self._apply(logits, allow_all, None)

    def observe(self, tokens: torch.Tensor, slots: np.ndarray, rows: np.ndarray) -> None:
        """The tokens just drawn (device, one per sampled slot): the masked rows' go home, and the
        mask thread advances their matchers by them and fills their next masks."""
        drawn = tokens if self.device_rows is None else tokens[self.device_rows]
        event = None
        if drawn.is_cuda:
            drawn = torch.empty(drawn.shape, dtype=drawn.dtype, pin_memory=True).copy_(drawn, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        masked = slots[rows].tolist()
        self.jobs.append(self.mask_thread.submit(self._advance, [self.matchers[slot] for slot in masked], masked,
                                                 drawn, event))

    def _advance(self, matchers: list[Future], slots: list[int], drawn: torch.Tensor, event) -> None:
        """On the mask thread: once a step's tokens are home, its matchers consume them and fill their
        next masks, both on llguidance's threads (one row: here, as handing it over costs more)."""
        if event is not None:
            event.synchronize()
        # a refused token leaves its matcher in error: it then allows only eos
        live = [(future.result(), token, slot) for future, token, slot in zip(matchers, drawn.tolist(), slots)]
        live = [entry for entry in live if entry[0] is not None]
        if len(live) == 1:
            matcher, token, slot = live[0]
            matcher.consume_token(token)
            fill_next_token_bitmask(matcher, self.next_masks, slot)
        elif live:
            consume_token_par(self._executor(), [(matcher, token) for matcher, token, _ in live])
            fill_next_token_bitmask_par(self._executor(), [(matcher, slot) for matcher, _, slot in live],
                                        self.next_masks)

    def _executor(self) -> LLExecutor:
        if self.executor is None:
            self.executor = LLExecutor(MASK_THREADS)
        return self.executor
