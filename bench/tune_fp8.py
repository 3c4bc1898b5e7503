"""Tunes the FP8 linear layers' launch choices on this GPU and writes them into
nanoserve_kernels/fp8_configs.json (its table for this device name), where fp8_linear reads them.

For each projection of the benchmark shapes (q/k/v, o, gate/up with its SiLU-and-mul, down; Qwen3-0.6B
and 8B, 128 x 128 weight blocks) and each batch-size bucket, every candidate is timed, its output
checked against the plain-torch reference first:
  - the weight-only Triton GEMM (up to 32 rows), in a few launch shapes, K split or not;
  - the W8A8 Triton GEMM, in a few launch shapes, K split or not, with the activations' quantization pass
    (not timed after a norm, which quantizes them itself when serving);
  - torch's blockwise scaled_mm (sm90), likewise; for gate/up followed by the SiLU-and-mul pass (it cannot
    fuse it), against the Triton GEMM's fused epilogue;
  - DeepGEMM's GEMM (nanoserve_kernels/deepgemm_fp8.py, where installed: bench/deepgemm.sh), likewise, at
    decode buckets: in its own tiling and in each of deepgemm_tiles.candidates (tile shapes within a wave of
    the fewest waves, TMA multicast on either operand or none).
The fastest per (N, K, bucket) is kept, with its time ("us") and that of the same layer in bf16 ("bf16_us":
the weight dequantized, run as the unquantized model runs it), from which fp8_configs.served_in_bf16 decides
where FP8 does not pay. Times are CUDA-graph replays of 20 calls or more (what serving runs), cycling
through copies of the weight that together exceed the L2 cache, so that every call reads from memory;
each bucket's candidates compile first, several at a time.
--recheck re-times only the table's stored choice, torch's scaled_mm (no compile), DeepGEMM and bf16 at the
buckets it has.

    python3 bench/tune_fp8.py [--shapes 0.6b 8b] [--buckets 2 4 ... 8192] [--budget-s 240] [--recheck] [--out FILE]
"""
import argparse
import concurrent.futures
import itertools
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from nanoserve_kernels import deepgemm_fp8, deepgemm_tiles, fp8_configs, fp8_reference  # noqa: E402
from nanoserve_kernels.fp8_configs import DEEPGEMM, SCALED_MM, TRITON, W8A8, WEIGHT_ONLY, Fp8Choice  # noqa: E402
from gemv import or_error, copies_past_l2  # noqa: E402  (bench/, this script's folder)

BLOCK = (128, 128)
SHAPES = {  # name -> [(N, K, silu_mul, after a norm)]: q/k/v, o, gate/up, down at one rank
    "0.6b": [(4096, 1024, False, True), (1024, 2048, False, False), (6144, 1024, True, True),
             (1024, 3072, False, False)],
    "8b": [(6144, 4096, False, True), (4096, 4096, False, False), (24576, 4096, True, True),
           (4096, 12288, False, False)],
}
BUCKETS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
WEIGHT_ONLY_MAX = 32  # measured: from 64 rows on, W8A8 won every shape
SPLITS, SPLIT_MAX_ROWS = (1, 2, 4), 256
DEEP_MAX_ROWS, DEEP_STAGES = 128, 6
SWAP_MAX_ROWS = 64


def launches(mode: str, rows: int, silu_mul: bool) -> list[dict]:
    """The launch shapes tried: a row block as tall as the bucket, 64 rows at most (the weight-only GEMM, at 32
    rows and under: 32 or 64 columns; W8A8: 64 or 128), and from 128 rows 128 x 64 and 128 x 128 tiles (not
    for the gate/up GEMM, which holds two accumulators), each with K unsplit or split over 2 or 4 programs (up
    to SPLIT_MAX_ROWS rows: a 4,096-row projection has 32-64 tiles of 128 x 128 for 132 multiprocessors);
    W8A8 each with its tiles loaded by pointers and through tensor descriptors (TMA). At decode batches (up to
    DEEP_MAX_ROWS rows), where a W8A8 call reads its weight at well under the copy rate, TMA launches also try
    narrower 32-column tiles (twice the programs, no split's partial sums) and a deeper pipeline (DEEP_STAGES
    tiles in flight a program) for more bytes in flight. Up to SWAP_MAX_ROWS rows, both modes also try tiles
    computed transposed (SWAP_AB: 64 or 128 weight rows on the tensor cores' M side, the batch on N)."""
    height = min(64, max(16, rows))
    tiles = [(height, 32), (height, 64)] if mode == WEIGHT_ONLY else [(height, 64), (height, 128)]
    if mode == W8A8 and rows >= 128:
        tiles += [(128, 64)] + ([] if silu_mul else [(128, 128)])
    shapes = []
    tma = (False, True) if mode == W8A8 else (False,)
    splits = SPLITS if rows <= SPLIT_MAX_ROWS else (1,)
    for (block_m, block_n), split, through_tma in itertools.product(tiles, splits, tma):
        tile = block_m * block_n  # 8 warps from 64 x 128 on: with 4, its float32 sums and the scaled step spill
        shapes.append(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, num_warps=8 if tile >= 8192 else 4,
                           num_stages=3 if tile >= 128 * 128 else 4, SPLIT_K=split, TMA=through_tma))
    if rows <= SWAP_MAX_ROWS:
        for block_n, split in itertools.product((64, 128), splits):
            shapes.append(dict(BLOCK_M=height, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, num_warps=4,
                               num_stages=DEEP_STAGES if mode == W8A8 else 4, SPLIT_K=split, TMA=mode == W8A8,
                               SWAP_AB=True))
    if mode == W8A8 and rows <= DEEP_MAX_ROWS:
        for (block_n, stages), split in itertools.product(((32, 4), (32, DEEP_STAGES), (64, DEEP_STAGES)), splits):
            shapes.append(dict(BLOCK_M=height, BLOCK_N=block_n, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=stages,
                               SPLIT_K=split, TMA=True))
    return shapes


def graph_time(fn, copies: list[tuple], calls: int = 20) -> float:
    """Seconds per fn(*copy), replaying a CUDA graph of `calls` calls or more that cycle through the weight's
    copies (together past the L2 cache, so each call reads its weight from memory as serving does; after
    one eager call compiles)."""
    fn(*copies[0])
    torch.cuda.synchronize()
    calls = max(calls, len(copies))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*copies[i % len(copies)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / (5 * calls)


def candidates(x, weight, silu_mul: bool, after_norm: bool, stored: Fp8Choice | None):
    """(choice, fn(weight, scale)) pairs for x and this weight's shape; only the stored choice (and scaled_mm,
    DeepGEMM) when given. A W8A8 call quantizes x first, in the layout its GEMM takes, except after a norm (q/k/v,
    gate/up), where serving has the norm quantize it (nanoserve_model/row_fusion.py): there x is quantized
    once, outside the timed call."""
    from nanoserve_kernels.fp8_linear import input_layout, quantized_linear, takes_deepgemm, takes_scaled_mm
    from nanoserve_kernels.triton_fp8_gemm import fp8_gemm
    from nanoserve_kernels.triton_fp8_quant import quantize_activation
    rows = x.shape[0]

    def weight_only(launch):
        return lambda weight, scale: fp8_gemm(x, weight, scale, BLOCK, launch, silu_mul=silu_mul)

    def w8a8(chosen: Fp8Choice):
        layout = input_layout(chosen, x.shape, weight, BLOCK)
        quantized = quantize_activation(x, **layout) if after_norm else None

        def run(weight, scale):
            return quantized_linear(quantized or quantize_activation(x, **layout), rows, x.dtype, weight, scale,
                                    BLOCK, silu_mul=silu_mul, chosen=chosen)
        return run

    scaled_mm = Fp8Choice(W8A8, SCALED_MM, fp8_configs.default_choice(fp8_configs.bucket(rows)).launch)
    deepgemm = Fp8Choice(W8A8, DEEPGEMM, scaled_mm.launch)
    libraries = [(scaled_mm, takes_scaled_mm(x.shape[1], weight, BLOCK)),
                 (deepgemm, takes_deepgemm(rows, weight, BLOCK))]
    if stored is not None:  # and the libraries' GEMMs beside it (no tuning; the stored choice may predate them)
        yield stored, weight_only(stored.launch) if stored.mode == WEIGHT_ONLY else w8a8(stored)
        yield from ((chosen, w8a8(chosen)) for chosen, takes in libraries if takes
                    and (chosen.backend, chosen.launch) != (stored.backend, stored.launch))
        return
    if takes_deepgemm(rows, weight, BLOCK):  # DeepGEMM in tilings of our choosing too (deepgemm_tiles.py)
        sms = torch.cuda.get_device_properties(weight.device).multi_processor_count
        for tiling in deepgemm_tiles.candidates(deepgemm_fp8.padded_rows(rows), weight.shape[0], sms):
            chosen = Fp8Choice(W8A8, DEEPGEMM, dict(scaled_mm.launch, **{DEEPGEMM: tiling}))
            yield chosen, w8a8(chosen)
    if rows <= WEIGHT_ONLY_MAX:
        for launch in launches(WEIGHT_ONLY, rows, silu_mul):
            yield Fp8Choice(WEIGHT_ONLY, TRITON, launch), weight_only(launch)
    for launch in launches(W8A8, rows, silu_mul):
        chosen = Fp8Choice(W8A8, TRITON, launch)
        yield chosen, w8a8(chosen)
    yield from ((chosen, w8a8(chosen)) for chosen, takes in libraries if takes)


def bf16_call(x, silu_mul: bool):
    """fn(weight) of the layer in bf16 as the model runs it at these rows (linear.linear; gate/up with its
    SiLU-and-mul fused where triton_gate_up takes the batch, as nanoserve_model/row_fusion.py does)."""
    from nanoserve_kernels.triton_activation import silu_and_mul
    from nanoserve_kernels.triton_gate_up import gate_up_silu, takes
    from nanoserve_model.linear import linear
    if not silu_mul:
        return lambda weight: linear(x, weight)
    return lambda weight: gate_up_silu(x, weight) if takes(x, weight) else silu_and_mul(linear(x, weight))


def reference(x, weight, scale, mode: str, silu_mul: bool) -> torch.Tensor:
    y = fp8_reference.fp8_linear(x, weight, scale, BLOCK, quantize_input=mode == W8A8)
    if not silu_mul:
        return y
    gate, up = y.float().chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


class ShapeTuner:
    """One projection shape on the GPU: its e4m3 weight and the weight copies past L2, e4m3 and bf16."""

    def __init__(self, n: int, k: int, silu_mul: bool, after_norm: bool):
        self.n, self.k, self.silu_mul, self.after_norm = n, k, silu_mul, after_norm
        self.weight, self.scale = fp8_reference.quantize_weight(torch.randn(n, k, device="cuda") * 0.02, BLOCK)
        self.fp8_copies = copies_past_l2(self.weight, self.scale)
        self.bf16_copies = copies_past_l2(fp8_reference.dequantize_weight(self.weight, self.scale, BLOCK,
                                                                          torch.bfloat16))

    def tune(self, rows: int, kept: dict | None) -> dict | None:
        """The table entry of the fastest FP8 choice at `rows` rows (only `kept`, re-timed, when given; and
        torch's scaled_mm), with its time and the bf16 call's; None if no candidate ran."""
        n, k, silu_mul, weight, scale = self.n, self.k, self.silu_mul, self.weight, self.scale
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        expected = {mode: reference(x, weight, scale, mode, silu_mul) for mode in (WEIGHT_ONLY, W8A8)}
        best, best_time = None, float("inf")
        tried = list(candidates(x, weight, silu_mul, self.after_norm, Fp8Choice(**kept) if kept else None))

        def first_call(item):  # on a pool thread, whose driver calls (DeepGEMM's) need the device's context current
            torch.cuda.set_device(weight.device)
            return or_error(item[1], weight, scale)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # compiles, several at a time (ptxas outside the GIL)
            outputs = list(pool.map(first_call, tried))
        for (chosen, fn), got in zip(tried, outputs):
            try:
                if isinstance(got, Exception):
                    got = fn(weight, scale)  # once more alone: two compiles at once may have been the cause
                error = float((got.float() - expected[chosen.mode].float()).norm() / expected[chosen.mode].norm())
                if error > 2e-2:
                    print(f"  {n}x{k} rows {rows} {chosen.mode}/{chosen.backend} {chosen.launch}: wrong ({error:.1e})")
                    continue
                seconds = graph_time(fn, self.fp8_copies)
            except Exception as err:  # a launch shape that does not fit, a torch without the backend
                print(f"  {n}x{k} rows {rows} {chosen.mode}/{chosen.backend}: {type(err).__name__}: {err}"[:200])
                continue
            print(f"    {seconds * 1e6:8.1f} us {chosen.mode}/{chosen.backend} {chosen.launch}")
            if seconds < best_time:
                best, best_time = chosen, seconds
        if best is None:
            return None
        bf16_time = graph_time(bf16_call(x, silu_mul), self.bf16_copies)
        tflops = 2 * rows * n * k / best_time / 1e12
        print(f"{n:>6}x{k:<6}{' silu' if silu_mul else '     '} rows {rows:>5}: {best_time * 1e6:8.1f} us "
              f"(bf16 {bf16_time * 1e6:8.1f}) {best.mode:>11} {best.backend:>9} {tflops:6.1f} TFLOP/s {best.launch}",
              flush=True)
        return dict(mode=best.mode, backend=best.backend, launch=best.launch, us=round(best_time * 1e6, 3),
                    bf16_us=round(bf16_time * 1e6, 3))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    p.add_argument("--buckets", type=int, nargs="+", default=BUCKETS,
                   help="in the order to tune them, every shape at a bucket before the next bucket")
    p.add_argument("--budget-s", type=float, default=600.0, help="stop tuning after this long (what is tuned is kept)")
    p.add_argument("--out", type=Path, default=fp8_configs.CONFIG_FILE, help="the table to update")
    p.add_argument("--recheck", action="store_true",
                   help="re-time only the table's choice, torch's scaled_mm and bf16 where it has the bucket: "
                        "minutes less")
    args = p.parse_args()
    deadline = time.monotonic() + args.budget_s
    device = torch.cuda.get_device_name()
    tables = json.loads(args.out.read_text()) if args.out.exists() else {}
    table = fp8_configs.this_device_table(tables)
    print(f"tuning FP8 linears on {device}, torch {torch.__version__}")
    shapes = [ShapeTuner(*shape) for name in args.shapes for shape in SHAPES[name]]
    for rows, shape in itertools.product(args.buckets, shapes):
        key = fp8_configs.shape_key(shape.n, shape.k, shape.silu_mul)
        if time.monotonic() > deadline:
            print(f"  budget spent: {key} stops before {rows} rows")
            continue
        kept = table.get(key, {}).get(str(rows)) if args.recheck else None
        entry = shape.tune(rows, kept)
        if entry is not None:
            table.setdefault(key, {})[str(rows)] = entry
            args.out.write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")  # what is tuned is kept
    print(f"wrote {args.out}")
    for shape in shapes:
        if fp8_configs.served_in_bf16(device, shape.n, shape.k, shape.silu_mul, tables):
            print(f"{fp8_configs.shape_key(shape.n, shape.k, shape.silu_mul)}: served in bf16 (faster at the decode "
                  "buckets)")


if __name__ == "__main__":
    main()
