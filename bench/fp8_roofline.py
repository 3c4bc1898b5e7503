"""The floor of the DESIGN throughput workload on the 8B shape, bf16 weights against FP8 weights (and an FP8
KV cache): what ratio FP8 weights can reach at all, before any kernel is measured.

The workload (bench/throughput.py, seed 0) is replayed as the scheduler runs it when every request fits the
KV cache at once (the 8B shape's 1,427 blocks of bf16 KV hold all 256 requests): every prompt prefilled,
then decode step s carries each request that still has tokens to produce, with its context so far. A step
costs its linear layers, max(weight bytes / bandwidth, FLOPs / GEMM rate), then its attention, the KV
bytes of every running sequence / bandwidth (the two run one after the other in each layer); prefill costs
its FLOPs / GEMM rate. The LM head stays bf16 in both. Rates are given, not measured here: the copy rate
and two GEMM rates, the dense peaks (989 / 1,979 TFLOP/s on an H100 SXM) and what the kernels reach on
these shapes (bench/tune_fp8.py: cuBLAS bf16 ~700, torch's blockwise FP8 scaled_mm ~1,050).

    python3 bench/fp8_roofline.py [--bandwidth-tbps 3.0]
"""
import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

import throughput  # noqa: E402  (bench/, this script's folder)

LAYERS, HIDDEN, KV_HEADS, HEAD_DIM = 36, 4096, 8, 128
LINEAR_PARAMS = LAYERS * (6144 * 4096 + 4096 * 4096 + 24576 * 4096 + 4096 * 12288)  # q/k/v, o, gate/up, down
LM_HEAD_PARAMS = 151936 * 4096
SCALE_BYTES = LINEAR_PARAMS // (128 * 128) * 4  # one float32 per 128 x 128 block
RATES = {"dense peak": (989e12, 1979e12), "kernels here": (700e12, 1050e12)}  # (bf16, FP8) FLOP/s


def schedule() -> tuple[list[int], list[tuple[int, int]]]:
    """(prompt lengths, [(running sequences, context tokens read) per decode step])."""
    jobs = throughput.workload(*throughput.WORKLOADS["design"])
    steps = [[0, 0] for _ in range(max(out for _, out in jobs) - 1)]
    for prompt, out in jobs:
        for step in range(out - 1):  # the first token comes from the prefill
            steps[step][0] += 1
            steps[step][1] += len(prompt) + 1 + step
    return [len(prompt) for prompt, _ in jobs], [tuple(step) for step in steps]


def seconds(prompts: list[int], steps: list[tuple[int, int]], bandwidth: float, linear_rate: float,
            head_rate: float, weight_bytes: float, kv_bytes_per_token: float) -> tuple[float, float]:
    """(decode seconds, prefill seconds) at these rates."""
    decode = sum(max(weight_bytes / bandwidth, 2 * rows * (LINEAR_PARAMS / linear_rate + LM_HEAD_PARAMS / head_rate))
                 + context * kv_bytes_per_token / bandwidth for rows, context in steps)
    flops = sum(2 * p * LINEAR_PARAMS + 2 * p * p * HIDDEN * LAYERS for p in prompts)  # projections, causal attention
    return decode, flops / linear_rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bandwidth-tbps", type=float, default=3.0, help="the copy rate (H100: ~3.0 of 3.35 TB/s)")
    args = p.parse_args()
    prompts, steps = schedule()
    kv_token = LAYERS * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
    bf16_weights = 2 * (LINEAR_PARAMS + LM_HEAD_PARAMS)
    fp8_weights = LINEAR_PARAMS + SCALE_BYTES + 2 * LM_HEAD_PARAMS
    outputs = sum(rows for rows, _ in steps) + len(prompts)
    print(f"{len(prompts)} requests, {sum(prompts):,} prompt and {outputs:,} output tokens; {len(steps)} decode "
          f"steps, {sum(rows for rows, _ in steps) / len(steps):.0f} sequences and "
          f"{sum(c for _, c in steps) * kv_token / len(steps) / 1e9:.1f} GB of bf16 KV a step on average; weights "
          f"read a step: {bf16_weights / 1e9:.2f} GB bf16, {fp8_weights / 1e9:.2f} GB FP8")
    bandwidth = args.bandwidth_tbps * 1e12
    for name, (bf16_rate, fp8_rate) in RATES.items():
        base = seconds(prompts, steps, bandwidth, bf16_rate, bf16_rate, bf16_weights, kv_token)
        line = f"{name} ({bf16_rate / 1e12:.0f} / {fp8_rate / 1e12:.0f} TFLOP/s): bf16 {base[0]:.2f} + {base[1]:.2f} s"
        line += f" = {outputs / sum(base):,.0f} tok/s"
        for label, kv in (("FP8", kv_token), ("FP8 + FP8 KV", kv_token / 2)):
            fp8 = seconds(prompts, steps, bandwidth, fp8_rate, bf16_rate, fp8_weights, kv)
            line += f"; {label} {fp8[0]:.2f} + {fp8[1]:.2f} s = {outputs / sum(fp8):,.0f} ({sum(base) / sum(fp8):.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
