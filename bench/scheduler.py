"""CPU cost of the scheduler: one round of schedule(), encoding the step message, postprocess().

Decode rounds with 256 and 1,024 running sequences of ~1,000 tokens, and one 16,384-token
prefill step. The target is well under a GPU step: < 1 ms per decode round at 256 sequences.

    PYTHONPATH=.:proto python bench/scheduler.py [--out bench/out/scheduler.json]
"""
import argparse
import json
import random
import statistics
import time
from pathlib import Path

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.scheduler import Scheduler
from scheduler_svc.sequence import SamplingOptions, Sequence
from scheduler_svc.step_encoder import encode_step

BLOCK_SIZE = 16
CONTEXT = 1000
NEVER_STOP = SamplingOptions(ignore_eos=True)


def _scheduler(num_seqs: int, max_tokens_per_seq: int, budget: int) -> Scheduler:
    config = SchedulerConfig(num_kv_blocks=num_seqs * (max_tokens_per_seq // BLOCK_SIZE + 2),
                             block_size=BLOCK_SIZE, max_model_len=max_tokens_per_seq + 1,
                             max_num_seqs=num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config)


def _random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(10000) for _ in range(length)]


def decode_rounds(num_seqs: int, num_rounds: int) -> list[float]:
    """CPU seconds per round, once all sequences are decoding. Context lengths are staggered so
    that block boundaries (a new block, a hash) fall on different rounds, as they do live."""
    rng = random.Random(0)
    scheduler = _scheduler(num_seqs, CONTEXT + BLOCK_SIZE + num_rounds, budget=16384)
    for seq_id in range(num_seqs):
        scheduler.enqueue(Sequence(seq_id, _random_prompt(rng, CONTEXT + seq_id % BLOCK_SIZE), NEVER_STOP))
    while scheduler.num_waiting:  # prefill everything first
        plan = scheduler.schedule()
        scheduler.postprocess(plan, [1] * len(plan.sampled))
    times = []
    for _ in range(num_rounds):
        start = time.thread_time()
        plan = scheduler.schedule()
        encode_step(plan)
        scheduler.postprocess(plan, [rng.randrange(10000)] * len(plan.sampled))
        times.append(time.thread_time() - start)
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
    args = parser.parse_args()
    results = {
        "decode_256_seqs": _summary(decode_rounds(256, args.rounds)),
        "decode_1024_seqs": _summary(decode_rounds(1024, args.rounds)),
        "prefill_16384_tokens": _summary(prefill_rounds(16384, 20)),
    }
    print("CPU time of this thread per round")
    print(f"{'case':<22}{'mean ms':>10}{'median ms':>11}{'min ms':>9}{'max ms':>9}")
    for case, row in results.items():
        print(f"{case:<22}" + "".join(f"{row[key]:>{width}.3f}" for key, width in
                                      (("mean_ms", 10), ("median_ms", 11), ("min_ms", 9), ("max_ms", 9))))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"block_size": BLOCK_SIZE, "context_tokens": CONTEXT, **results}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
