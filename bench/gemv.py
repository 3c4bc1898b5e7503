"""Batch-1 linear layers: nanoserve_kernels/triton_gemv.py against torch's F.linear (cuBLAS) on the
projections of a decode layer (Qwen3-0.6B and 8B shapes). Each timing is one call of a CUDA graph
holding REPLAYS back-to-back launches, as a decode graph replays them, so launch gaps count; the
rate is weight bytes over time. `--sweep` also times every tile shape and warp count (each line:
the chosen tiles, then the best), to check the heuristic of `tiles`.

    PYTHONPATH=.:proto python bench/gemv.py [--sweep] [--out bench/out/gemv.json]
"""
import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoserve_kernels.triton_gemv import MAX_TILE, gemv, tiles

SHAPES = {  # (name, N, K) of one layer's projections: W is [N, K]
    "0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)],
}
REPLAYS = 50


def time_per_call(fn, repeats: int = 20) -> float:
    """Seconds per fn() replayed inside a CUDA graph of REPLAYS calls (median of `repeats` replays)."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAYS):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / REPLAYS)
    return sorted(times)[len(times) // 2]


def sweep(x: torch.Tensor, w: torch.Tensor) -> tuple[float, tuple[int, int, int]]:
    """The fastest (seconds, (block_n, block_k, warps)) of every tile shape within twice the bound."""
    best = None
    for block_n, block_k, warps in itertools.product((1, 2, 4, 8), (1024, 2048, 4096), (4, 8)):
        if block_n * block_k > 2 * MAX_TILE or block_k > 2 * triton_pow2(w.shape[1]):
            continue
        seconds = time_per_call(lambda: gemv(x, w, block_n=block_n, block_k=block_k, num_warps=warps), 7)
        if best is None or seconds < best[0]:
            best = (seconds, (block_n, block_k, warps))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time every tile shape and warp count too")
    parser.add_argument("--out", type=Path, default=Path("bench/out/gemv.json"))
    args = parser.parse_args()
    device = torch.device("cuda")
    rows, report = [], []
    for model, shapes in SHAPES.items():
        for name, n, k in shapes:
            x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5
            ref = F.linear(x.float(), w.float())
            error = ((gemv(x, w).float() - ref).norm() / ref.norm()).item()
            assert error < 1e-2, (model, name, error)
            cublas, ours = time_per_call(lambda: F.linear(x, w)), time_per_call(lambda: gemv(x, w))
            entry = dict(model=model, layer=name, n=n, k=k, tiles=tiles(n, k), cublas_us=cublas * 1e6,
                         gemv_us=ours * 1e6, cublas_tbps=w.nbytes / cublas / 1e12, gemv_tbps=w.nbytes / ours / 1e12)
            line = (f"{model:<5}{name:<8}{n:>7}{k:>7}  {str(entry['tiles']):<11}{entry['cublas_us']:>9.2f}"
                    f"{entry['gemv_us']:>9.2f}{entry['cublas_tbps']:>8.2f}{entry['gemv_tbps']:>8.2f}")
            if args.sweep:
                best_seconds, best = sweep(x, w)
                entry.update(best_us=best_seconds * 1e6, best=best)
                line += f"{entry['best_us']:>9.2f} {best}"
            report.append(entry)
            rows.append(line)
            print(line, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("model layer      N      K  tiles       cuBLAS us  gemv us  cuBLAS TB/s  gemv TB/s"
          + ("  best us (block_n, block_k, warps)" if args.sweep else ""))
    print("\n".join(rows))
    total = {model: (sum(e["cublas_us"] for e in report if e["model"] == model),
                     sum(e["gemv_us"] for e in report if e["model"] == model)) for model in SHAPES}
    for model, (cublas, ours) in total.items():
        print(f"{model}: one layer's projections {cublas:.1f} us with cuBLAS, {ours:.1f} us with gemv")


def triton_pow2(value: int) -> int:
    return 1 << (value - 1).bit_length()


if __name__ == "__main__":
    main()
