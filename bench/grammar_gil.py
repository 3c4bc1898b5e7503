"""What a JSON-schema constraint costs a launcher-bound batch-1 worker, on the CPU (issue 40): the step
period of a stand-in launcher thread (--launcher-ms of small torch calls a step, each letting go of the
GIL as the real launcher's do; 1.25 ms as the 0.6B shape's batch-1 step on an H200), with a stand-in
device (a step's forward runs from when it is queued, halfway through the launcher's step, its draw
from when that is queued, after the masks) and a reply thread that wakes when each step's device work
ends and answers it (a StepResponse), as worker_svc/server.py's does; at most MAX_STEPS_IN_FLIGHT steps
are launched and not yet answered, as the scheduler sends them.

A constrained step runs rank 0's real grammar hooks on bench/grammar.py's LONG schema and Qwen3's
vocabulary (GrammarMasks: draw_masks before the draw, observe after it); the draw picks a token its
mask allows. What differs between the runs is which thread advances the matchers after a step (the
callable observe() returns):
- `reply`: the step's reply thread, once it has answered the step (what the worker does);
- `before-reply`: the step's reply thread, the moment the step's tokens are home, before it answers
  (the worker's order before: the scheduler, which sends a step on each answer, waited for the advance);
- `launcher`: nobody, so the launcher runs it at the next masked step, in series with its own work;
- `mask-thread`: a thread of its own, handed each step's advance (the layout before: one more thread
  to wake and to hand the GIL to, each step).

At batch 1 the worker's launcher thread is its bottleneck (bench/RESULTS.md), so what a constraint
adds is the launcher's own extra work plus every hand-over of the GIL to the other threads.

    python3 bench/grammar_gil.py [--launcher-ms 1.25] [--device-ms 1.0] [--steps 600] [--repeats 3]
"""
import argparse
import json
import queue
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from grammar import LONG, write_result  # noqa: E402
from nanoserve.grammar_tokenizer import GrammarTokenizer  # noqa: E402
from nanoserve.v1 import worker_pb2  # noqa: E402
from scheduler_svc.structured_outputs import GrammarCompiler  # noqa: E402
from worker_svc.grammar_masks import GrammarMasks  # noqa: E402
from worker_svc.launched_step import MAX_STEPS_IN_FLIGHT  # noqa: E402
from worker_svc.server import GIL_SWITCH_SECONDS  # noqa: E402

MODES = ("plain", "reply", "before-reply", "launcher", "mask-thread")
QWEN3_VOCAB, QWEN3_EOS = 151_936, (151_645,)
DRAW_MS = 0.03  # the device's part of a step after its draw is queued (the race's two launches)


class DeviceEnd:
    """A step's end on the stand-in device, as a CUDA event: query() says whether it has passed,
    synchronize() sleeps (GIL released) until it has."""

    def __init__(self, at: float):
        self.at = at

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))


def allowed_token(mask_row: np.ndarray, rng: np.random.Generator) -> int:
    """A token the mask row allows (the lowest bit of a random non-zero word); 0 if none."""
    words = np.flatnonzero(mask_row)
    if not len(words):
        return 0
    word = int(words[rng.integers(len(words))])
    bits = int(mask_row[word]) & 0xFFFFFFFF
    return 32 * word + (bits & -bits).bit_length() - 1


class Worker:
    """The stand-in launcher and reply threads around one slot of GrammarMasks."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str, args: argparse.Namespace):
        self.tokenizer, self.grammar, self.args = tokenizer, grammar, args
        self.scratch = torch.zeros(16)
        self.calls = 0  # the launcher's torch calls a step (calibrate)

    def launcher_work(self) -> None:
        """Half a step's launcher work (before the forward is queued, or after the draw): small torch
        calls, each dropping and taking back the GIL."""
        for _ in range(self.calls // 2):
            self.scratch.add_(1)

    def calibrate(self) -> None:
        """As many torch calls a step as take --launcher-ms on this host, alone."""
        self.calls = 2000
        started = time.perf_counter()
        self.launcher_work()
        self.calls = max(2, round(self.args.launcher_ms / 1e3 / ((time.perf_counter() - started) / 1000)))

    def run(self, mode: str) -> float:
        """The median step period in ms, the first tenth of the steps left out."""
        masks = GrammarMasks(1, self.tokenizer, torch.device("cpu"))
        slots = np.zeros(1, np.int64)
        device_slots = torch.from_numpy(slots)
        open_row = np.full(masks.words, -1, np.int32)
        if mode != "plain":
            masks.reset(0, self.grammar, [])
            masks.fill_first_masks()
        replies: queue.SimpleQueue = queue.SimpleQueue()
        in_flight = threading.Semaphore(MAX_STEPS_IN_FLIGHT)
        reply_thread = threading.Thread(target=self.reply_loop, args=(replies, in_flight))
        reply_thread.start()
        mask_thread = ThreadPoolExecutor(1)
        rng, periods, device_free = np.random.default_rng(0), [], time.perf_counter()
        last = time.perf_counter()
        forward_s = (self.args.device_ms - DRAW_MS) / 1e3
        for _ in range(self.args.steps):
            in_flight.acquire()  # the step's request has come
            self.launcher_work()
            forward_end = max(device_free, time.perf_counter()) + forward_s  # the forward is queued
            row, advance = open_row, None
            if mode != "plain":
                rows = masks.constrained_rows(slots)
                masks.draw_masks(slots, rows, device_slots)
                row = masks.next_masks[0]
            drawn = torch.tensor([allowed_token(row, rng)])
            device_free = max(forward_end, time.perf_counter()) + DRAW_MS / 1e3  # the draw is queued
            end = DeviceEnd(device_free)
            if mode != "plain":
                advance = masks.observe(drawn, end, slots, rows)
                if mode == "mask-thread":
                    mask_thread.submit(advance)
            replies.put((end, drawn, advance if mode in ("reply", "before-reply") else None, mode == "reply"))
            self.launcher_work()
            now = time.perf_counter()
            periods.append(now - last)
            last = now
        replies.put(None)
        reply_thread.join()
        mask_thread.shutdown()
        return 1e3 * statistics.median(periods[len(periods) // 10:])

    def reply_loop(self, replies: queue.SimpleQueue, in_flight: threading.Semaphore) -> None:
        """Each step: wait for its end, answer it (the scheduler then sends another step), and run its
        advance after the answer (reply mode) or before it (before-reply mode)."""
        while (item := replies.get()) is not None:
            end, drawn, advance, after = item
            end.synchronize()
            if advance is not None and not after:
                advance()
            reply = worker_pb2.StepResponse(step_id=1, token_ids=drawn.tolist(), busy_seconds=1e-3)
            reply.SerializeToString()
            in_flight.release()
            if advance is not None and after:
                advance()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=str(REPO / ".cache" / "tiny-qwen3" / "tokenizer.json"))
    p.add_argument("--launcher-ms", type=float, default=1.25, help="the stand-in launcher's work a step, alone")
    p.add_argument("--device-ms", type=float, default=1.0, help="the stand-in device's step")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--repeats", type=int, default=3, help="rounds over the modes; the median of each is kept")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "grammar_gil.json"))
    args = p.parse_args()
    sys.setswitchinterval(GIL_SWITCH_SECONDS)  # the worker's
    tokenizer = GrammarTokenizer(Path(args.tokenizer), QWEN3_VOCAB, QWEN3_EOS)
    worker = Worker(tokenizer, GrammarCompiler(tokenizer).compile("json", json.dumps(LONG)), args)
    worker.calibrate()
    periods: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):  # interleaved, so that the machine's load drifts over every mode alike
        for mode in MODES:
            periods[mode].append(worker.run(mode))
    step_ms = {mode: statistics.median(values) for mode, values in periods.items()}
    write_result({"step_ms": step_ms, "runs_ms": periods, "launcher_calls": worker.calls,
                  "added_percent": {mode: 100 * (step_ms[mode] / step_ms["plain"] - 1) for mode in MODES[1:]}},
                 Path(args.out))


if __name__ == "__main__":
    main()
