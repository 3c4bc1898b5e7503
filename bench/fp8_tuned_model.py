"""The 8B shape's throughput workload (bench/throughput.py), bf16 against FP8 weights, costed from the tuned table.

The projections' times are the ones the tuner measured (nanoserve_kernels/fp8_configs.json: each shape's FP8
call and its bf16 call at each batch bucket) rather than rates: what the table as tuned predicts, checked
against a measured pair, and what faster FP8 calls at decode batches would give.

The decode steps are bench/fp8_roofline.py's schedule. A step of r rows costs 36 layers of its bucket's four
projections, the bf16 LM head (max of its weight read and its FLOPs), its attention (the KV bytes of every
running sequence at the copy rate), and a constant for the rest (norms, rotary, sampling, launch gaps) fitted
so that the bf16 steps average the measured bf16 step; prefill takes the measured prefill rates. With
--fp8-rate-tbps, every FP8 call up to --up-to-rows rows instead reads its e4m3 weight at that rate (where
that is faster than the table's time).

    python3 bench/fp8_tuned_model.py [--device "NVIDIA H100 80GB HBM3"] [--fp8-rate-tbps 2.56 --up-to-rows 128]
"""
import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import fp8_roofline  # noqa: E402  (bench/, this script's folder)
from nanoserve_kernels.fp8_configs import CONFIG_FILE, bucket, shape_key  # noqa: E402

# the 8B shape's projections at one rank: (N, K, SiLU-and-mul) of q/k/v, o, gate/up, down
PROJECTIONS = ((6144, 4096, False), (4096, 4096, False), (24576, 4096, True), (4096, 12288, False))
# measured on an H100 (bench/RESULTS.md, 2026-11-28, `bash bench/gpu_fp8.sh perf`): mean decode step, prefill rate
MEASURED = {"bf16_step_ms": 12.93, "fp8_step_ms": 11.34, "bf16_prefill": 41_735, "fp8_prefill": 60_124,
            "bf16_tok_s": 8_018, "fp8_tok_s": 9_542}


def layer_ms(table: dict, rows: int, fp8: bool, rate: float | None, up_to_rows: int) -> float:
    """One layer's four projections at `rows` rows, from the table's bucket (FP8 or its bf16 call)."""
    total = 0.0
    for n, k, silu_mul in PROJECTIONS:
        entry = table[shape_key(n, k, silu_mul)][str(bucket(rows))]
        us = entry["us"] if fp8 else entry["bf16_us"]
        if fp8 and rate and rows <= up_to_rows:
            us = min(us, n * k / rate * 1e6)  # e4m3: a byte a weight
        total += us / 1e3
    return total


def decode_ms(table: dict, steps: list[tuple[int, int]], fp8: bool, bandwidth: float, rate: float | None = None,
              up_to_rows: int = 0) -> list[float]:
    """Each decode step's modelled time less the fitted constant (ms)."""
    kv_token = fp8_roofline.LAYERS * fp8_roofline.KV_HEADS * fp8_roofline.HEAD_DIM * 2 * 2
    head = lambda rows: max(2 * fp8_roofline.LM_HEAD_PARAMS / bandwidth,  # noqa: E731
                            2 * rows * fp8_roofline.LM_HEAD_PARAMS / 700e12) * 1e3
    return [fp8_roofline.LAYERS * layer_ms(table, rows, fp8, rate, up_to_rows) + head(rows)
            + context * kv_token / bandwidth * 1e3 for rows, context in steps]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="NVIDIA H100 80GB HBM3", help="the table's device")
    p.add_argument("--bandwidth-tbps", type=float, default=3.0, help="the copy rate of the KV and LM head reads")
    p.add_argument("--fp8-rate-tbps", type=float, help="FP8 calls read their weight at this rate instead")
    p.add_argument("--up-to-rows", type=int, default=128, help="for batches of up to this many rows")
    args = p.parse_args()
    table = json.loads(CONFIG_FILE.read_text())[args.device]
    prompts, steps = fp8_roofline.schedule()
    bandwidth = args.bandwidth_tbps * 1e12
    bf16 = decode_ms(table, steps, False, bandwidth)
    rest = MEASURED["bf16_step_ms"] - sum(bf16) / len(steps)  # the constant: the bf16 mean as measured
    fp8 = decode_ms(table, steps, True, bandwidth)
    outputs = sum(rows for rows, _ in steps) + len(prompts)

    def tok_s(step_ms: list[float], prefill_rate: float) -> float:
        return outputs / ((sum(step_ms) + rest * len(steps)) / 1e3 + sum(prompts) / prefill_rate)

    base = tok_s(bf16, MEASURED["bf16_prefill"])
    print(f"{len(steps)} decode steps; the fitted rest of a step {rest:.2f} ms; bf16 {base:,.0f} tok/s "
          f"(measured {MEASURED['bf16_tok_s']:,})")
    as_tuned = tok_s(fp8, MEASURED["fp8_prefill"])
    print(f"FP8 as tuned: mean step {sum(fp8) / len(steps) + rest:.2f} ms (measured {MEASURED['fp8_step_ms']}), "
          f"{as_tuned:,.0f} tok/s, {as_tuned / base:.3f}x (measured "
          f"{MEASURED['fp8_tok_s'] / MEASURED['bf16_tok_s']:.3f}x)")
    if args.fp8_rate_tbps:
        faster = decode_ms(table, steps, True, bandwidth, args.fp8_rate_tbps * 1e12, args.up_to_rows)
        what_if = tok_s(faster, MEASURED["fp8_prefill"])
        print(f"FP8 calls of up to {args.up_to_rows} rows at {args.fp8_rate_tbps} TB/s: mean step "
              f"{sum(faster) / len(steps) + rest:.2f} ms, {what_if:,.0f} tok/s, {what_if / base:.3f}x")


if __name__ == "__main__":
    main()
