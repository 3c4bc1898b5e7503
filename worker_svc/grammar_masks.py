"""Grammar-constrained sampling on the sampling rank: per slot of the sequence table, the llguidance
matcher of a constrained sequence, beside the penalty state SamplingExtras keeps, so no mask ever
crosses the wire.

Each constrained slot's next mask is filled ahead, into a per-slot table in pinned host memory, and
copied to the device's copy of the table by whoever fills it. After each step that drew constrained
rows, the matchers consume the drawn tokens and fill their next masks (llguidance's native fill drops
the GIL; many rows go to llguidance's own threads). That advance is done by the step's reply thread,
which is awake once the step's tokens are home (it waits for them to answer the scheduler, and answers
first), so it costs no thread of its own a wake-up and no extra hand-over of the GIL: at batch 1 the worker is
bound by the launcher thread's Python, and every hand-over is launcher time (bench/grammar_gil.py).
The launcher thread meanwhile builds and queues step N+1's forward pass; only right before step N+1's
draw does it need step N's advance, normally done by then (if not, it waits for it, or does it
itself: RunOnce). New sequences' first masks wait for their grammar's compile, so one mask thread
fills them, after the slot's last advance. The launcher then hands the draw its masks: either to the
sampler (draw_masks), whose race kernel reads each row's mask from the device's table beside its
logits, so a masked draw costs the launcher no copy and no launch of its own; or, when other logits
processors or logprobs follow, by masking the logits in place in one launch (mask), before them. Only
steps that sample constrained rows wait for the previous step's tokens; the others (prefills and
resets included) keep the pipeline as deep as it is. mask_timings.py splits the time per step.

A grammar is compiled once per text (a template matcher, cached; each sequence takes a copy) on a
thread of its own, off the step loop. A reset also replays the generated tokens the scheduler sends,
so a recomputed sequence (preemption, a worker restart) resumes its grammar where it was."""
import functools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import consume_token_par, fill_next_token_bitmask_par

from nanoserve.grammar_tokenizer import GrammarTokenizer
from nanoserve_kernels.token_bitmask import TokenMasks, apply_token_bitmask, bitmask_words
from nanoserve_model.logits_processors import upload
from worker_svc.mask_timings import MaskTimings
from worker_svc.run_once import RunOnce

log = logging.getLogger("nanoserve.worker")

# Distinct grammars whose compiled template is kept.
TEMPLATE_CACHE_SIZE = 256
# llguidance's threads consuming a step's tokens and filling its masks. Inside a JSON string a row's
# consume takes ~1 us and its mask ~3 us (its first one in the string ~0.5 ms): 256 rows take ~1 ms on
# one core of the busy 2-core development machine, so a few threads do; every further thread is one more
# that a busy host may deschedule in the middle of a step's rows, holding up the whole step.
MASK_THREADS = max(1, min(4, (os.cpu_count() or 2) // 4))
# At most this many filled rows are copied to the device on the steps' own stream, behind the forward
# pass: a side stream's event would cost the launcher a call, more than a few 19 KB rows cost the device.
SIDE_STREAM_ROWS = 4


class GrammarMasks:
    def __init__(self, capacity: int, tokenizer: GrammarTokenizer, device: torch.device):
        self.tokenizer, self.device = tokenizer, device
        self.words = bitmask_words(tokenizer.vocab_size)
        self.matchers: list[Future | None] = [None] * capacity  # per slot; its result an LLMatcher, or None
        self.constrained = np.zeros(capacity, bool)  # per slot: holds a matcher
        self.num_constrained = 0  # slots holding a matcher: while 0, no batch is looked at
        pinned = device.type == "cuda"
        # Per slot: the mask of its matcher's next token, kept current by the advances and first masks; pinned,
        # so a step's rows go to the device straight from here, with no per-step buffer. Plain tensors, not
        # the runner's inference tensors: the threads that fill them copy rows with no mode to enter.
        with torch.inference_mode(False):  # (views made in that mode could not be written outside it either)
            self.host_table = torch.zeros((capacity, self.words), dtype=torch.int32, pin_memory=pinned)
            self.device_table = self.host_table.to(device) if pinned else self.host_table
            # each slot's row of both tables, made once: a batch-1 step's copy is one call on the reply thread
            self.row_pairs = list(zip(self.device_table.unbind(0), self.host_table.unbind(0)))
        self.next_masks = self.host_table.numpy()
        # where llguidance fills a slot's row: address + slot * row_bytes
        self.table_address, self.row_bytes = self.host_table.data_ptr(), 4 * self.words
        # Whoever fills rows queues their copy to the device's table: a few on the steps' stream, more (up to
        # 19 KB each) on a stream of their own, beside the forward pass still running, with an event after
        # them that the steps' stream waits for before its next masked draw or copy.
        self.step_stream = torch.cuda.default_stream(device) if pinned else None
        self.copy_stream = torch.cuda.Stream(device) if pinned else None
        self.side_copied: torch.cuda.Event | None = None  # the last side-stream copy, not yet waited for
        self.new_sequences: list[tuple[int, Future]] = []  # this step's resets, their first masks not yet asked for
        self.jobs: list[Future] = []  # the mask thread's jobs (first masks) since the last masked step
        self.advance: RunOnce | None = None  # the last masked step's advance, until the next one needs it
        self.every_row = True  # whether every row the current step samples is masked
        self.compiler = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self.mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")  # first masks, in order
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
        matchers exist and the last masked step's advance is done (it may still fill a reset slot's
        row with the mask of the sequence that left it)."""
        if self.new_sequences:
            self.jobs.append(self.mask_thread.submit(self._fill_first, self.new_sequences, self.advance))
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

    def _fill_first(self, new_sequences: list[tuple[int, Future]], advance: RunOnce | None) -> None:
        """On the mask thread: new sequences' first masks (a grammar that failed to compile allows only
        eos: the sequence can only end), after `advance`."""
        if advance is not None:
            advance.run()
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
        self._copy_rows([slot for slot, _ in new_sequences])
        self.timings.add(first=time.perf_counter() - started)

    def _fill(self, live: list[tuple[LLMatcher, int]]) -> None:
        """Each matcher's next mask into its slot's row: on llguidance's threads, one row here (handing
        it over costs more), straight into the row's memory."""
        if len(live) == 1:
            matcher, slot = live[0]
            matcher.unsafe_compute_mask_ptr(self.table_address + slot * self.row_bytes, self.row_bytes)
        elif live:
            fill_next_token_bitmask_par(self._executor(), live, self.next_masks)

    def constrained_rows(self, slots: np.ndarray) -> np.ndarray:
        """Positions in `slots` (a step's sampled slots) of constrained sequences."""
        if not self.num_constrained:
            return np.zeros(0, np.int64)
        return np.flatnonzero(self.constrained[slots])

    def mask(self, logits: torch.Tensor, slots: np.ndarray, rows: np.ndarray, device_slots: torch.Tensor) -> None:
        """Masks, in place, the logits rows `rows` (constrained_rows of `slots`, the step's sampled
        slots, which `device_slots` holds on the device) by their grammars: one launch, for a step whose
        logits other processors or logprobs read after the masks."""
        started, waited = self._rows_ready(slots, rows)
        device_rows = None if self.every_row else upload(rows, self.device)
        mask_rows = device_slots if device_rows is None else device_slots[device_rows]
        self._apply(logits, self.device_table, mask_rows, device_rows)
        self.timings.masked_step(len(rows), launcher_wait=waited - started, queue=time.perf_counter() - waited)

    def draw_masks(self, slots: np.ndarray, rows: np.ndarray, device_slots: torch.Tensor) -> TokenMasks:
        """The masks of the step's draw (rows and slots as for mask()), for the sampler to apply: each
        sampled row reads its slot's row of the device's table, or none (an unconstrained row)."""
        started, waited = self._rows_ready(slots, rows)
        table_rows = (device_slots if self.every_row else
                      upload(np.where(self.constrained[slots], slots, -1), self.device))
        self.timings.masked_step(len(rows), launcher_wait=waited - started, queue=time.perf_counter() - waited)
        return TokenMasks(self.device_table, table_rows)

    def _rows_ready(self, slots: np.ndarray, rows: np.ndarray) -> tuple[float, float]:
        """Waits for the last masked step's advance and the first masks since (each has queued the copy
        of the rows it filled to the device), and has the steps' stream wait for those copies made on
        the side stream; when the wait began and ended."""
        started = time.perf_counter()
        if self.advance is not None:
            self.advance.run()  # normally done already, by the step's reply
        for job in self.jobs:  # each, so that any job's error surfaces here
            job.result()
        self.jobs.clear()
        waited = time.perf_counter()
        self.every_row = len(rows) == len(slots)
        self._wait_side_copy()
        return started, waited

    def _copy_rows(self, slots: list[int]) -> None:
        """Queues the copy of the table's rows from the first to the last of `slots`, just filled, to the
        device's table, for the next masked draw; fills never overlap (a first mask waits for the last
        advance, the next advance for the next masked draw, which waits for both), and no masked draw is
        in flight while one runs: its tokens, drawn there, are home. A copy on the steps' stream comes
        after the last side-stream copy, which may cover its rows with their old contents."""
        if self.device_table is self.host_table or not slots:  # on a CPU they are one
            return
        first, end = min(slots), max(slots) + 1
        if len(slots) <= SIDE_STREAM_ROWS or self.copy_stream is None:
            self._wait_side_copy()
            # on the filling thread's current stream: its default one, the steps' (launched_step.py)
            if end - first == 1:
                device_row, host_row = self.row_pairs[first]
                device_row.copy_(host_row, non_blocking=True)
            else:
                self.device_table[first:end].copy_(self.host_table[first:end], non_blocking=True)
            return
        with torch.cuda.stream(self.copy_stream):
            self.device_table[first:end].copy_(self.host_table[first:end], non_blocking=True)
        self.side_copied = torch.cuda.Event()
        self.side_copied.record(self.copy_stream)

    def _wait_side_copy(self) -> None:
        """Has the steps' stream wait for the last side-stream copy, if any since it last did."""
        if self.side_copied is not None:
            self.step_stream.wait_event(self.side_copied)
            self.side_copied = None

    def unmasked_step(self) -> None:
        """A sampled step with no constrained row: a run of masked steps, if any, has ended."""
        self.timings.log_run(log)

    def warm_up(self, logits: torch.Tensor) -> TokenMasks:
        """Runs the mask kernel in both its variants (some rows, every row) with masks that keep every
        token, so that it compiles at start-up, never while serving; the same masks for every row, for
        the sampler's masked race to warm up with."""
        allow_all = torch.full((len(logits), self.words), -1, dtype=torch.int32, device=logits.device)
        every = torch.arange(len(logits), device=logits.device)
        self._apply(logits, allow_all, every, every)
        self._apply(logits, allow_all, every, None)
        return TokenMasks(allow_all, every)

    def observe(self, drawn: torch.Tensor, event: torch.cuda.Event | None, slots: np.ndarray,
                rows: np.ndarray) -> Callable[[], None]:
        """The step's drawn tokens on their way home (`drawn`, one per sampled slot, in host memory
        once `event` has passed; None: already there): returns the advance of the masked rows'
        matchers by them, for the step's reply to run once they are home (without waiting, if another
        thread is running it); the next masked step runs it if that has not."""
        masked = slots[rows].tolist()
        positions = None if self.every_row else rows.tolist()
        self.advance = RunOnce(functools.partial(self._advance, [self.matchers[slot] for slot in masked], masked,
                                                 drawn, positions, event))
        return self.advance.run_unless_busy

    def _advance(self, matchers: list[Future], slots: list[int], drawn: torch.Tensor, positions: list[int] | None,
                 event: torch.cuda.Event | None) -> None:
        """Once a step's tokens are home, its matchers consume them and fill their next masks, both on
        llguidance's threads (one row: here, as handing it over costs more). A slot handed to another
        sequence since is left alone: the old one is gone, and the new one's first mask is its own job's,
        which runs after this."""
        started = time.perf_counter()
        if event is not None and not event.query():  # query() keeps the GIL: the reply has waited already
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
        self._copy_rows([slot for _, _, slot in live])
        self.timings.add(tokens_wait=home - started, consume=consumed - home, fill=time.perf_counter() - consumed)

    def _executor(self) -> LLExecutor:
        if self.executor is None:
            self.executor = LLExecutor(MASK_THREADS)
        return self.executor
