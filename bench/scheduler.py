"""CPU cost of the scheduler: one round of schedule(), encoding the step message, postprocess(),
with steps in flight as the engine keeps them (the tokens of the step built now come back three
rounds later; --steps-in-flight 1 post-processes each step before the next one is built).

Decode rounds with 256 and 1,024 running sequences of ~1,000 tokens; mixed rounds (issue 15), in
which the same 256 sequences decode while chunks of 2,048-token prompts take 512 more tokens (an
online step) or the rest of the default 8,192-token budget; and one 16,384-token prefill step. The
target is well under a GPU step: < 1 ms per decode or mixed round at 256 sequences. A mixed round
costs a decode round plus its prompt tokens' own work (blocks taken, hashed and freed, token ids
encoded), which a prefill step of the same tokens costs as well. Blocks are the server's default
size (--block-size 256); `--block-size 16` multiplies the per-block work by 16 (a stress case).
--kv-events measures the rounds with KV events on (the scheduler's --kv-events-config): the events
are logged and taken once per round, as the engine hands them to its publishing thread.

    PYTHONPATH=.:proto python bench/scheduler.py [--block-size 256] [--kv-events] [--out bench/out/scheduler.json]
"""
import argparse
import collections
import json
import random
import statistics
import time
from pathlib import Path

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.kv_event_log import KVEventLog
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import SamplingOptions, Sequence
from scheduler_svc.step_encoder import encode_step

BLOCK_SIZE = 256  # the server's default; main() sets it from --block-size
STEPS_IN_FLIGHT = 3  # as a worker takes them (worker_svc MAX_STEPS_IN_FLIGHT); main() sets it
CONTEXT = 1000
MIXED_BUDGET = 8192  # --max-num-batched-tokens' default
MIXED_PROMPT = 2048  # tokens of each prompt that mixed rounds prefill
NEVER_STOP = SamplingOptions(ignore_eos=True)
KV_EVENTS = False  # main() sets it from --kv-events


def _scheduler(num_seqs: int, max_tokens_per_seq: int, budget: int, max_model_len: int = 0,
               extra_blocks: int = 0) -> Scheduler:
    """Blocks for num_seqs sequences of max_tokens_per_seq tokens, and extra_blocks more."""
    config = SchedulerConfig(num_kv_blocks=num_seqs * (max_tokens_per_seq // BLOCK_SIZE + 2) + extra_blocks,
                             block_size=BLOCK_SIZE, max_model_len=max(max_model_len, max_tokens_per_seq + 1),
                             max_num_seqs=num_seqs + 64, max_num_batched_tokens=budget)
    return Scheduler(config, KVEventLog(BLOCK_SIZE) if KV_EVENTS else None)


def _take_events(scheduler: Scheduler) -> None:
    if scheduler.kv_events is not None:
        scheduler.kv_events.take()


def _random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(10000) for _ in range(length)]


def _decoding(rng: random.Random, num_seqs: int, num_rounds: int, budget: int, **more) -> Scheduler:
    """A scheduler whose num_seqs sequences have computed their prompts and decode from now on.
    Context lengths are staggered so that block boundaries (a new block, a hash) fall on different
    rounds, as they do live."""
    scheduler = _scheduler(num_seqs, CONTEXT + BLOCK_SIZE + num_rounds, budget, **more)
    for seq_id in range(num_seqs):
        scheduler.enqueue(Sequence(seq_id, _random_prompt(rng, CONTEXT + seq_id % BLOCK_SIZE), NEVER_STOP))
    while scheduler.num_waiting:  # prefill everything first
        plan = scheduler.schedule()
        scheduler.postprocess(plan, [1] * len(plan.sampled))
    return scheduler


class Rounds:
    """Rounds as the engine runs them: each builds and encodes the next step while STEPS_IN_FLIGHT
    steps are out, then post-processes the oldest, so decodes of tokens still in flight send none
    (--steps-in-flight 1: every step's tokens come back before the next is built)."""

    def __init__(self, scheduler: Scheduler, rng: random.Random):
        self.scheduler, self.rng = scheduler, rng
        self.in_flight: collections.deque = collections.deque()

    def timed(self) -> float:
        start = time.thread_time()
        plan = self.scheduler.schedule()
        encode_step(plan)
        self.in_flight.append(plan)
        if len(self.in_flight) >= STEPS_IN_FLIGHT:
            done = self.in_flight.popleft()
            self.scheduler.postprocess(done, [self.rng.randrange(10000)] * len(done.sampled))
        _take_events(self.scheduler)
        return time.thread_time() - start


def decode_rounds(num_seqs: int, num_rounds: int) -> list[float]:
    """CPU seconds per round, once all sequences are decoding."""
    rng = random.Random(0)
    scheduler = _decoding(rng, num_seqs, num_rounds, budget=16384)
    rounds = Rounds(scheduler, rng)
    return [rounds.timed() for _ in range(num_rounds)]


def mixed_rounds(num_seqs: int, num_rounds: int, prompt_tokens: int) -> list[float]:
    """CPU seconds per mixed round: num_seqs sequences decode, and prompt_tokens of MIXED_PROMPT-token
    prompts (one token out each, so they leave at once) fill the rest of the budget, split across
    rounds; their blocks are allocated, hashed as they fill, and freed."""
    rng = random.Random(0)
    prompts_per_round = prompt_tokens // MIXED_PROMPT + 2
    scheduler = _decoding(rng, num_seqs, num_rounds, num_seqs + prompt_tokens, max_model_len=MIXED_PROMPT + 1,
                          extra_blocks=(STEPS_IN_FLIGHT + 1) * prompts_per_round * MIXED_PROMPT // BLOCK_SIZE)
    prompts = [Sequence(num_seqs + i, _random_prompt(rng, MIXED_PROMPT), SamplingOptions(max_tokens=1))
               for i in range(num_rounds * prompt_tokens // MIXED_PROMPT + prompts_per_round)]
    times, rounds = [], Rounds(scheduler, rng)
    for _ in range(num_rounds):
        while scheduler.num_waiting < prompts_per_round:  # queued outside the timed round, as a handler does
            scheduler.enqueue(prompts.pop())
        times.append(rounds.timed())
    return times


def prefill_rounds(num_tokens: int, repeats: int) -> list[float]:
    """CPU seconds for one step that prefills a single num_tokens prompt, on a fresh scheduler each time."""
    rng = random.Random(0)
    times = []
    for _ in range(repeats):
        scheduler = _scheduler(1, num_tokens + 1, budget=num_tokens)
        scheduler.enqueue(Sequence(0, _random_prompt(rng, num_tokens), NEVER_STOP))
        start = time.thread_time()
        plan = scheduler.schedule()
        encode_step(plan)
        scheduler.postprocess(plan, [1])
        _take_events(scheduler)
        times.append(time.thread_time() - start)
    return times


def _summary(times: list[float]) -> dict[str, float]:
    return {"mean_ms": statistics.fmean(times) * 1e3, "median_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3, "rounds": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/out/scheduler.json"))
    parser.add_argument("--rounds", type=int, default=200, help="decode rounds per case")
    parser.add_argument("--block-size", type=int, default=256, help="tokens per KV block")
    parser.add_argument("--steps-in-flight", type=int, default=3, help="1: post-process each step before the next")
    parser.add_argument("--kv-events", action="store_true", help="with KV events logged and taken every round")
    args = parser.parse_args()
    global BLOCK_SIZE, STEPS_IN_FLIGHT, KV_EVENTS
    BLOCK_SIZE, STEPS_IN_FLIGHT, KV_EVENTS = args.block_size, args.steps_in_flight, args.kv_events
    results = {
        "decode_256_seqs": _summary(decode_rounds(256, args.rounds)),
        "decode_1024_seqs": _summary(decode_rounds(1024, args.rounds)),
        "mixed_256_seqs_512_prompt": _summary(mixed_rounds(256, args.rounds, 512)),
        "mixed_256_seqs_7936_prompt": _summary(mixed_rounds(256, args.rounds, MIXED_BUDGET - 256)),
        "prefill_16384_tokens": _summary(prefill_rounds(16384, 20)),
    }
    print("CPU time of this thread per round")
    print(f"{'case':<28}{'mean ms':>10}{'median ms':>11}{'min ms':>9}{'max ms':>9}")
    for case, row in results.items():
        print(f"{case:<28}" + "".join(f"{row[key]:>{width}.3f}" for key, width in
                                      (("mean_ms", 10), ("median_ms", 11), ("min_ms", 9), ("max_ms", 9))))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"block_size": BLOCK_SIZE, "steps_in_flight": STEPS_IN_FLIGHT, "kv_events": KV_EVENTS,
              "context_tokens": CONTEXT, **results}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
