"""torch's FP8 GEMMs (cuBLASLt) by weight scaling, on the 8B shape's projections: what a per-output-channel
checkpoint (compressed-tensors FP8_DYNAMIC, --quantization fp8) could take against Qwen's 128 x 128 blocks.
Per (N, K) and batch rows, the microseconds of one call (CUDA-graph replays cycling through weight copies
past the L2 cache, bench/gemv.py's timer), activations already quantized, output bf16:
  bf16      the unquantized layer (F.linear)
  block     scaled_mm with 1 x 128 activation groups and 128 x 128 weight blocks (what block FP8 serves)
  rowwise   scaled_mm with one scale per token and one per output channel
and each FP8 call's output against the bf16 product of its dequantized operands (max relative error).

    python3 bench/fp8_scalings.py [--rows 32 64 128 256 512 2048 8192] [--out FILE]
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto"), str(REPO / "bench")]
from gemv import time_per_call, weight_copies  # noqa: E402  (bench/, this script's folder)
from nanoserve_kernels.fp8_reference import dequantize_weight, quantize_weight  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def block_mm(x_q, x_s, w_q, w_s):
    if hasattr(F, "scaled_mm"):
        return F.scaled_mm(x_q, w_q.t(), x_s, F.ScalingType.BlockWise1x128, w_s.t(), F.ScalingType.BlockWise128x128,
                           output_dtype=torch.bfloat16)
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=w_s.t(), out_dtype=torch.bfloat16)


def rowwise_mm(x_q, x_s, w_q, w_s):
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=w_s.t(), out_dtype=torch.bfloat16)


def rel_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.float() - reference).abs().max() / reference.abs().max()).item()


def measure(name: str, n: int, k: int, rows: int) -> dict:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    result = {"layer": name, "n": n, "k": k, "rows": rows}
    weights = weight_copies(w)
    result["bf16_us"] = time_per_call(lambda weight: F.linear(x, weight), weights) * 1e6
    x_pad = F.pad(x, (0, 0, 0, -rows % 4))  # blockwise scaled_mm takes rows in fours
    for scaling, (x_block, w_block, mm) in {"block": ((1, 128), (128, 128), block_mm),
                                           "rowwise": ((1, k), (1, k), rowwise_mm)}.items():
        x_q, x_s = quantize_weight(x_pad if scaling == "block" else x, x_block)
        w_q, w_s = quantize_weight(w, w_block)
        reference = dequantize_weight(x_q, x_s, x_block)[:rows] @ dequantize_weight(w_q, w_s, w_block).t()
        if scaling == "block":
            x_s = x_s.t().contiguous().t()  # token-minor, as cuBLAS wants
        try:
            y = mm(x_q, x_s, w_q, w_s)[:rows]
            result[f"{scaling}_error"] = rel_error(y, reference)
            result[f"{scaling}_us"] = time_per_call(lambda weight: mm(x_q, x_s, weight, w_s), weight_copies(w_q)) * 1e6
        except RuntimeError as error:  # not on this torch or device
            result[f"{scaling}_error"] = str(error).splitlines()[0][:200]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128, 256, 512, 2048, 8192])
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'layer':8} {'rows':>5} {'bf16 us':>8} {'block us':>9} {'rowwise us':>11}   errors (block, rowwise)")
    results = []
    for rows in args.rows:
        for name, (n, k) in SHAPES.items():
            r = measure(name, n, k, rows)
            results.append(r)
            fmt = lambda key: f"{r[key]:.1f}" if key in r else "-"  # noqa: E731
            print(f"{name:8} {rows:5} {fmt('bf16_us'):>8} {fmt('block_us'):>9} {fmt('rowwise_us'):>11}   "
                  f"{r['block_error']!s:.8} {r['rowwise_error']!s:.8}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
