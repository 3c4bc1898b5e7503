"""The MLP's gate/up projection with SiLU-and-mul in its GEMM epilogue (nanoserve_kernels/triton_gate_up.py)
against cuBLAS then the SiLU-and-mul kernel, as decode steps run them, at the Qwen3-0.6B and 8B shapes:
bench/gemv.py's method (CUDA graphs of back-to-back calls, the weight read from memory). Batches past
triton_gate_up.MAX_ROWS are timed too: they show why the model keeps the separate kernels there.
`--sweep` also times launch shapes at each batch size up to MAX_ROWS, to check `tiles` on another GPU.

    PYTHONPATH=.:proto python bench/gate_up.py [--sweep] [--models 0.6b 8b] [--out bench/out/gate_up.json]
"""
import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from bench.gemv import SHAPES, time_per_call, weight_copies  # noqa: E402
from nanoserve_kernels.triton_activation import silu_and_mul  # noqa: E402
from nanoserve_kernels.triton_gate_up import MAX_ROWS, gate_up_silu, tiles  # noqa: E402

BATCHES = (2, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def launch_shapes(rows: int):
    """Row blocks no taller than twice the batch, tiles that fit shared memory with their stages."""
    for bm, bn, bk, warps, stages in itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4)):
        if bm > max(16, 2 * rows) or (warps == 8 and bm * bn < 64 * 64) or stages * (bm + 2 * bn) * bk * 2 > 200 * 1024:
            continue
        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def measure(model: str, sweep: bool) -> list[dict]:
    (_, two_d, k), = (shape for shape in SHAPES[model] if shape[0] == "gate_up")
    w = torch.randn(two_d, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    weights, report = weight_copies(w), []
    for rows in BATCHES:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        expected = silu_and_mul(F.linear(x, w)).float()
        error = ((gate_up_silu(x, w).float() - expected).norm() / expected.norm()).item()
        assert error < 1e-2, (model, rows, error)
        entry = dict(model=model, rows=rows, d=two_d // 2, k=k, tiles=tiles(rows, k),
                     separate_us=time_per_call(lambda w: silu_and_mul(F.linear(x, w)), weights) * 1e6,
                     fused_us=time_per_call(lambda w: gate_up_silu(x, w), weights) * 1e6)
        line = f"{model:<5}{rows:>5}{entry['separate_us']:>13.2f}{entry['fused_us']:>10.2f}"
        if sweep and rows <= MAX_ROWS:
            timings = {json.dumps(shape): time_per_call(lambda w: gate_up_silu(x, w, shape), weights, 7) * 1e6
                       for shape in launch_shapes(rows)}
            best = min(timings, key=timings.get)
            entry.update(best_us=timings[best], best=json.loads(best), sweep_us=timings)
            line += f"{entry['best_us']:>9.2f}  {best}"
        report.append(entry)
        print(line, flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time launch shapes at each batch size too")
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--out", type=Path, default=Path("bench/out/gate_up.json"))
    args = parser.parse_args()
    print("model rows  separate us  fused us" + ("  best us  its launch shape" if args.sweep else ""))
    report = [entry for model in args.models for entry in measure(model, args.sweep)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
