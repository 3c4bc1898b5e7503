"""Worker host time of ModelRunner._apply (sequence table + sampling extras) for a step that resets
256 sequences and for a 256-sequence decode step, CPU, tiny Qwen3; the reset step's size on the wire.

    .venv/bin/python bench/worker_apply.py [REPO] [--top-p 0.9 --top-k 50]
"""
import argparse, statistics, sys, time
from pathlib import Path
ap = argparse.ArgumentParser(); ap.add_argument("repo", nargs="?", default=str(Path(__file__).resolve().parent.parent)); ap.add_argument("--top-p", type=float); ap.add_argument("--top-k", type=int)
args = ap.parse_args()
REPO = Path(args.repo).resolve()
sys.path[:0] = [str(REPO), str(REPO / "proto"), str(REPO / "tests" / "worker")]
from nanoserve_cli.cache import cache_dir
from scheduler_svc.sequence import SamplingOptions
from scheduler_svc.step_encoder import encode_sampling
from worker_steps import StepWriter, cpu_runner
N = 256
runner = cpu_runner(cache_dir() / "tiny-qwen3", block_size=16, num_blocks=N * 4, max_num_seqs=N, max_num_batched_tokens=32768)
extra = {k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k)) if v is not None}
sampling = encode_sampling(SamplingOptions(temperature=0.6, ignore_eos=True, max_tokens=1000, **extra))
writer = StepWriter(16)
resets, decodes, encoded = [], [], []
for rnd in range(30):
    ids = range(rnd * 1000, rnd * 1000 + N)
    entries = []
    for seq_id in ids:
        e = writer.entry(seq_id, [7] * 32, reset=True); e.sampling.CopyFrom(sampling); entries.append(e)
    request = writer.request(*entries)
    encoded.append(len(request.SerializeToString()))
    t = time.perf_counter(); runner._apply(request); resets.append(time.perf_counter() - t)
    for step in range(3):
        request = writer.request(*[writer.entry(seq_id, [], 32 + step, num_generated=step + 1) for seq_id in ids])
        t = time.perf_counter(); runner._apply(request); decodes.append(time.perf_counter() - t)
    runner._apply(writer.request(forget=tuple(ids)))
    writer.next_block = 0
med = lambda xs: statistics.median(xs[3:]) * 1e3
print(f"{REPO.name:<10}{' top_p/k' if extra else '':<9} apply: 256 resets {med(resets):6.3f} ms, 256 decodes {med(decodes):6.3f} ms "
      f"(min {min(resets)*1e3:.3f} / {min(decodes)*1e3:.3f}); reset step {encoded[0]} bytes")
