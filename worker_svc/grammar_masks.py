"""Grammar-constrained sampling on the sampling rank: per slot of the sequence table, the llguidance
matcher of a constrained sequence, beside the penalty state SamplingExtras keeps, so no mask ever
crosses the wire.

A step that samples constrained rows asks each row's matcher for its mask (filled on the host by
llguidance's own threads while the step's forward pass runs on the device), uploads the rows and masks
the logits in one launch before every other logits processor. The matcher then moves on by the token
the row drew: the draw stays on the device, so its copy home is queued after the step and read by the
next step that masks. Only steps that sample constrained rows wait for the previous step's tokens;
the others (prefills and resets included) keep the pipeline as deep as it is.

A grammar is compiled once per text (a template matcher, cached; each sequence takes a copy) on a
thread of its own, off the step loop: a reset submits the work and the sequence's first masked step
picks it up, by which time its prompt is usually being computed. A reset also replays the generated
tokens the scheduler sends, so a recomputed sequence (preemption, a worker restart) resumes its
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
        # Drawn tokens on their way home: (the matchers they advance, the tokens, their copy's event).
        self.pending: list[tuple[list[Future], torch.Tensor, object]] = []
        self.device_rows: torch.Tensor | None = None  # the masked rows of the current step; None: all of them
        self.compiler = ThreadPoolExecutor(2, thread_name_prefix="grammar")
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

    def constrained_rows(self, slots: np.ndarray) -> np.ndarray:
        """Positions in `slots` (a step's sampled slots) of constrained sequences."""
        if not self.num_constrained:
            return np.zeros(0, np.int64)
        return np.flatnonzero(self.constrained[slots])

    def mask(self, logits: torch.Tensor, slots: np.ndarray, rows: np.ndarray) -> None:
        """Masks, in place, the logits rows `rows` (constrained_rows of `slots`) by their grammars."""
        self.advance()
        matchers = [self.matchers[slot].result() for slot in slots[rows].tolist()]
        # Filled where the copy to the device starts from (pinned on CUDA: the caching host allocator
        # hands the block out again only once its copy is done); llguidance writes whole rows.
        pinned = torch.empty((len(rows), self.words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        bitmask = pinned.numpy()
        live = [(matcher, i) for i, matcher in enumerate(matchers) if matcher is not None]
        if len(live) == 1:  # on this thread: handing one row to the pool costs more than it saves
            matcher, index = live[0]
            fill_next_token_bitmask(matcher, bitmask, index)
        elif live:
            fill_next_token_bitmask_par(self._executor(), live, bitmask)
        for i in np.flatnonzero([matcher is None for matcher in matchers]):  # failed to compile: it can only end
            bitmask[i] = 0
            for eos in self.tokenizer.eos_token_ids:
                bitmask.view(np.uint32)[i, eos // 32] |= np.uint32(1 << (eos % 32))
        self.device_rows = None if len(rows) == len(logits) else upload(rows, self.device)
        self._apply(logits, pinned.to(self.device, non_blocking=True), self.device_rows)

    def warm_up(self, logits: torch.Tensor) -> None:
        """Runs the mask kernel in both its variants (some rows, every row) with masks that keep every
        token, so that it compiles at start-up, never while serving."""
        allow_all = torch.full((len(logits), self.words), -1, dtype=torch.int32, device=logits.device)
        self._apply(logits, allow_all, torch.arange(len(logits), device=logits.device))
        self._apply(logits, allow_all, None)

    def observe(self, tokens: torch.Tensor, slots: np.ndarray, rows: np.ndarray) -> None:
        """The tokens just drawn (device, one per sampled slot): the masked rows' go home, for the
        matchers to consume before they mask again."""
        drawn = tokens if self.device_rows is None else tokens[self.device_rows]
        event = None
        if drawn.is_cuda:
            drawn = torch.empty(drawn.shape, dtype=drawn.dtype, pin_memory=True).copy_(drawn, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.pending.append(([self.matchers[slot] for slot in slots[rows].tolist()], drawn, event))

    def advance(self) -> None:
        """Feeds the tokens that have come home to their matchers, in step order: a step's rows on
        llguidance's threads (the mask fill's pool), as its masks are filled, since this wait sits
        between a step's draw and the next step's masks."""
        for matchers, drawn, event in self.pending:
            if event is not None:
                event.synchronize()
            # a refused token leaves its matcher in error: it then allows only eos
            live = [(future.result(), token) for future, token in zip(matchers, drawn.tolist())]
            live = [(matcher, token) for matcher, token in live if matcher is not None]
            if len(live) == 1:
                live[0][0].consume_token(live[0][1])
            elif live:
                consume_token_par(self._executor(), live)
        self.pending.clear()

    def _executor(self) -> LLExecutor:
        if self.executor is None:
            self.executor = LLExecutor(MASK_THREADS)
        return self.executor

