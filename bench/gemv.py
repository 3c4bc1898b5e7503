"""Batch-1 linear layers: nanoserve_kernels/triton_gemv.py against torch's F.linear (cuBLAS) on the
projections of a decode layer (Qwen3-0.6B and 8B shapes). Each timing is one call of a CUDA graph
holding REPLAYS back-to-back launches, as a decode graph replays them, so launch gaps count; the
calls cycle through copies of the weight that together exceed the L2 cache four times, so every
weight comes from memory as in a decode step (the 0.6B matrices alone fit in the H100's 50 MB
L2). The rate is weight bytes over time. `--sweep` also times every tile shape and warp count of
the call the model makes (fusions included; each line: that call with the chosen tiles, then the
best), to check the heuristic of `tiles`. `--fused` instead times, at the same shapes, the norm
(with the residual add) then the q/k/v or gate/up gemv, and the gate/up gemv then SiLU-and-mul, as
separate kernels (the compiled functions, as the model runs them without
nanoserve_model/row_fusion.py) against the gemv with them fused in.

`--fp8 block|row` runs the same with e4m3 weights (128 x 128 block scales, or one scale a row) against
the same layers in bf16 through cuBLAS, the kernel's e4m3 launch (fp8_configs.json's, else the default
e4m3 tiles) in place of the 16-bit one. With `--sweep` it times, per shape, launches of the model's call
(fp8_candidates: tiles, ways of summing and of loading around the stored launch, each checked against
Triton's conversion first; --budget-s of timing for all the shapes), and the same call in bf16 (the 16-bit
tiles); with `--fp8 block` it writes each shape's winner, its time and the bf16 time into the FP8 table as
bucket 1 (--table, default nanoserve_kernels/fp8_configs.json), where serving reads them.

    PYTHONPATH=.:proto python bench/gemv.py [--sweep | --fused] [--fp8 block|row] [--models 0.6b 8b] [--out F]
        [--budget-s S] [--table FILE]
"""
import argparse
import concurrent.futures
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoserve_kernels.fp8_configs import CONFIG_FILE, GEMV, tuned
from nanoserve_kernels.triton_gemv import gemv, rms_norm_gemv, thread_spanning_columns, tiles

SHAPES = {  # (name, N, K) of one layer's projections: W is [N, K]
    "0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)],
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)],
}
LM_HEADS = {"0.6b": ("lm_head", 151936, 1024), "8b": ("lm_head", 151936, 4096)}  # once a step, not a layer
REPLAYS = 64
L2_BYTES = 50 * 2**20
# an e4m3 gemv launch
LAUNCH_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "CONVERT", "SUM_ONCE", "STREAM", "X_BY_THREAD")
WORDS_AHEAD_BYTES = 128  # the e4m3 bytes a thread may hold of the tile loaded ahead (32 registers)
FP8_BLOCKS = {"block": lambda k: (128, 128), "row": lambda k: (1, k)}  # scale block of each --fp8 layout


def copies_past_l2(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Sets of copies of the tensors that together exceed the L2 cache four times: calls that cycle
    through them read their operands from memory, as serving does."""
    count = max(2, 4 * L2_BYTES // sum(t.nbytes for t in tensors) + 1)
    return [tuple(t.clone() for t in tensors) for _ in range(count)]


def weight_copies(w: torch.Tensor) -> list[torch.Tensor]:
    return [copy for copy, in copies_past_l2(w)]


def time_per_call(fn, weights: list[torch.Tensor], repeats: int = 20) -> float:
    """Seconds per fn(weight) replayed inside a CUDA graph of REPLAYS calls or more, one weight copy
    after another (median of `repeats` replays)."""
    fn(weights[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(weights[0])
    torch.cuda.current_stream().wait_stream(stream)
    calls = max(REPLAYS, len(weights))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def model_call(name: str, x: torch.Tensor):
    """The call the model makes for projection `name` at batch 1, taking (w, **tile_args): q/k/v and
    gate/up with the norm (and residual add) in their loads, gate/up with SiLU-and-mul in its output."""
    if name not in ("qkv", "gate_up"):
        return lambda w, **tile_args: gemv(x, w, **tile_args)
    residual = torch.randn_like(x)
    norm = (1 + 0.3 * torch.randn(x.shape[1], device=x.device)).to(x.dtype)
    return lambda w, **tile_args: rms_norm_gemv(x, residual, norm, 1e-6, w, silu_mul=name == "gate_up",
                                                **tile_args)[0]


def sweep(call, weights: list, k: int, fp8: str | None) -> dict[tuple[int, int, int], float]:
    """Seconds per call of every (block_n, block_k, warps) whose column tile fits the row twice at most
    (e4m3 rows are half as long in bytes, so one more row count)."""
    timings = {}
    block_ns = (2, 4, 8, 16) if fp8 else (1, 2, 4, 8)
    for block_n, block_k, warps in itertools.product(block_ns, (1024, 2048, 4096), (4, 8)):
        if block_k > 2 * triton_pow2(k):
            continue
        timings[block_n, block_k, warps] = time_per_call(
            lambda w: call(w, block_n=block_n, block_k=block_k, num_warps=warps), weights, 7)
    return timings


def fp8_candidates(k: int, silu_mul: bool, stored: dict | None = None) -> list[dict]:
    """Launches of the e4m3 gemv to time: Triton's conversion at the default tiles (the reference of the
    others) and the table's `stored` launch; at the stored tiles (else the default ones) the PTX conversion
    summing the other way (once a row or a tile at a time) and the weights loaded past L1 or not (STREAM);
    then the PTX conversion, summing and loading as stored, over a grid around the stored tiles: one, two or
    four times the rows by half to twice the columns, where a thread's tile loaded ahead stays within
    WORDS_AHEAD_BYTES; the other warp count at the stored and twice the rows; twice the rows loaded the other
    way. Right after the stored launch's own variants, x loaded by thread (X_BY_THREAD, summing once) at half,
    one and twice its rows, at 4 warps and its own, each at the narrowest column tile that spreads over every
    thread (triton_gemv.thread_spanning_columns); the grid keeps the stored X_BY_THREAD where its tiles spread so.
    (The integer conversion never won a sweep and is no longer tried.)"""
    default = tiles(k, silu_mul, fp8=True)
    rows, columns, warps = (stored["BLOCK_N"], stored["BLOCK_K"], stored["num_warps"]) if stored else default
    sum_once, stream = (stored["SUM_ONCE"], stored.get("STREAM", False)) if stored else (True, False)
    by_thread = stored.get("X_BY_THREAD", False) if stored else False

    def launch(convert: str, once: bool = sum_once, streamed: bool = stream, block_n: int = rows,
               block_k: int = columns, num_warps: int = warps, x_by_thread: bool = by_thread) -> dict:
        return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, CONVERT=convert, SUM_ONCE=once,
                    STREAM=streamed, X_BY_THREAD=x_by_thread and block_k >= thread_spanning_columns(num_warps))

    def fits(block_n: int, block_k: int, num_warps: int) -> bool:
        return (512 <= block_k <= 2 * triton_pow2(k)
                and block_n * block_k * (2 if silu_mul else 1) <= WORDS_AHEAD_BYTES * 32 * num_warps)

    other_warps = 12 - warps  # 4 <-> 8
    by_threads = [launch("ptx", True, block_n=block_n, block_k=block_k, num_warps=num_warps, x_by_thread=True)
                  for num_warps in dict.fromkeys((warps, 4))
                  for block_k in [max(columns, thread_spanning_columns(num_warps))]
                  for block_n in (rows, max(1, rows // 2), 2 * rows) if fits(block_n, block_k, num_warps)]
    grid = [launch("ptx", block_n=block_n, block_k=block_k) for block_n, block_k in itertools.product(
        (rows, 2 * rows, 4 * rows), (columns // 2, columns, 2 * columns)) if fits(block_n, block_k, warps)]
    grid += [launch("ptx", block_n=block_n, num_warps=other_warps) for block_n in (rows, 2 * rows)
             if fits(block_n, columns, other_warps)]
    grid += [launch("ptx", streamed=not stream, block_n=2 * rows, block_k=block_k)
             for block_k in (columns // 2, columns) if fits(2 * rows, block_k, warps)]
    launches = ([launch("triton", False, False, *default, x_by_thread=False)]
                + ([{**launch("triton"), **stored}] if stored else [])
                + [launch("ptx", not sum_once), launch("ptx", streamed=not stream)] + by_threads + grid)
    return [item for i, item in enumerate(launches) if item not in launches[:i]]


def fp8_sweep(call, weights: list, k: int, silu_mul: bool, budget_s: float, stored: dict | None
              ) -> dict[str, float]:
    """Seconds per call of each fp8_candidates launch (keyed by its JSON) that gives the Triton conversion's
    output (within bf16 rounding), for `budget_s` seconds; all compiled first, several at a time."""
    launches = fp8_candidates(k, silu_mul, stored)

    def run(launch: dict, weight=weights[0]):
        return call(weight, block_n=launch["BLOCK_N"], block_k=launch["BLOCK_K"], num_warps=launch["num_warps"],
                    convert=launch["CONVERT"], sum_once=launch["SUM_ONCE"], stream=launch["STREAM"],
                    x_by_thread=launch["X_BY_THREAD"])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # compiles: ptxas runs outside the GIL
        outputs = list(pool.map(lambda launch: or_error(run, launch), launches))
    # once more alone where it failed (were two compiles at once the cause, this one is not)
    outputs = [or_error(run, launch) if isinstance(out, Exception) else out for launch, out in zip(launches, outputs)]
    torch.cuda.synchronize()
    expected, timings, deadline = outputs[0].float(), {}, time.monotonic() + budget_s
    for launch, out in zip(launches, outputs):
        if isinstance(out, Exception) or time.monotonic() > deadline:
            print(f"  skipped {launch}: {out if isinstance(out, Exception) else 'budget spent'}"[:200], flush=True)
            continue
        error = ((out.float() - expected).norm() / expected.norm()).item()
        if error > 1e-2:
            print(f"  wrong {launch}: relative error {error:.1e}", flush=True)
            continue
        timings[json.dumps(launch, sort_keys=True)] = time_per_call(lambda w: run(launch, w), weights, 7)
    return timings


def or_error(fn, *args):
    try:
        return fn(*args)
    except Exception as err:  # a launch that does not compile or fit
        return err


def write_gemv_table(report: list[dict], table_file: Path) -> None:
    """Each shape's fastest e4m3 launch, with its time and the 16-bit call's, as bucket 1 of this device's
    FP8 table (nanoserve_kernels/fp8_configs.py)."""
    from nanoserve_kernels.fp8_configs import WEIGHT_ONLY, shape_key, this_device_table
    tables = json.loads(table_file.read_text()) if table_file.exists() else {}
    table = this_device_table(tables)
    for entry in report:
        key = shape_key(entry["n"], entry["k"], entry["layer"] == "gate_up")
        table.setdefault(key, {})["1"] = dict(mode=WEIGHT_ONLY, backend=GEMV, launch=entry["best_launch"],
                                             us=round(entry["best_us"], 3), bf16_us=round(entry["bf16_call_us"], 3))
    table_file.write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")


def fp8_weights(w: torch.Tensor, fp8: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of w in e4m3 with their scales (exceeding L2 as weight_copies does), as (weight, scale)."""
    from nanoserve_kernels.fp8_reference import quantize_weight
    return copies_past_l2(*quantize_weight(w, FP8_BLOCKS[fp8](w.shape[1])))


def fp8_call(call, fp8: str, k: int):
    """call(x-side args) taking a (weight, scale) pair as the model's FP8 linear passes them."""
    block = FP8_BLOCKS[fp8](k)
    return lambda pair, **tile_args: call(pair[0], weight_scale=pair[1], block=block, **tile_args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time every tile shape and warp count too")
    parser.add_argument("--fused", action="store_true", help="time the norm and SiLU-and-mul fusions instead")
    parser.add_argument("--fp8", choices=list(FP8_BLOCKS), help="e4m3 weights with these scales")
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--out", type=Path, help="default bench/out/gemv.json, or gemv_fused.json with --fused")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="--fp8 --sweep: seconds of timing for all the shapes (their compiles come first)")
    parser.add_argument("--table", type=Path, default=CONFIG_FILE,
                        help="--fp8 block --sweep writes each shape's winner here (bucket 1)")
    args = parser.parse_args()
    if args.fused:
        report = compare_fused(args.models)
        out = args.out or Path("bench/out/gemv_fused.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        return
    device = torch.device("cuda")
    rows, report = [], []
    shape_budget = args.budget_s / sum(len(SHAPES[model]) for model in args.models)
    for model in args.models:
        for name, n, k in SHAPES[model] + ([] if args.fp8 else [LM_HEADS[model]]):
            x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5
            ref = F.linear(x.float(), w.float())
            error = ((gemv(x, w).float() - ref).norm() / ref.norm()).item()
            assert error < 1e-2, (model, name, error)
            weights = weight_copies(w)
            cublas, ours = time_per_call(lambda w: F.linear(x, w), weights), time_per_call(lambda w: gemv(x, w), weights)
            weight_bytes = w.nbytes
            if args.fp8:  # "cuBLAS" stays the bf16 F.linear; "gemv" reads e4m3
                if args.sweep:  # the model's 16-bit call (fusions in), what the layer costs served in bf16
                    bf16_call = time_per_call(model_call(name, x), weights)
                del weights
                weights, weight_bytes = fp8_weights(w, args.fp8), w.numel()
                ours = time_per_call(fp8_call(lambda w, **t: gemv(x, w, **t), args.fp8, k), weights)
            entry = dict(model=model, layer=name, n=n, k=k, tiles=tiles(k, fp8=bool(args.fp8))[:2],
                         cublas_us=cublas * 1e6, gemv_us=ours * 1e6, cublas_tbps=w.nbytes / cublas / 1e12,
                         gemv_tbps=weight_bytes / ours / 1e12, fp8=args.fp8)
            line = (f"{model:<5}{name:<8}{n:>7}{k:>7}  {str(entry['tiles']):<11}{entry['cublas_us']:>9.2f}"
                    f"{entry['gemv_us']:>9.2f}{entry['cublas_tbps']:>8.2f}{entry['gemv_tbps']:>8.2f}")
            if args.sweep and args.fp8:
                call = fp8_call(model_call(name, x), args.fp8, k)
                stored = tuned(torch.cuda.get_device_name(), n, k, 1, name == "gate_up")
                timings = fp8_sweep(call, weights, k, name == "gate_up", shape_budget,
                                    stored.launch if stored and stored.backend == GEMV else None)
                best = min(timings, key=timings.get)
                entry.update(model_call_us=time_per_call(call, weights) * 1e6, best_us=timings[best] * 1e6,
                             best_launch=json.loads(best), bf16_call_us=bf16_call * 1e6,
                             sweep_us={config: seconds * 1e6 for config, seconds in timings.items()})
                launch = entry["best_launch"]
                line += (f"{entry['model_call_us']:>9.2f}{entry['best_us']:>9.2f}{entry['bf16_call_us']:>9.2f} "
                         f"{tuple(launch.get(key) for key in LAUNCH_KEYS)}")
            elif args.sweep:
                call = model_call(name, x)
                timings = sweep(call, weights, k, args.fp8)
                best = min(timings, key=timings.get)
                entry.update(model_call_us=time_per_call(call, weights) * 1e6, best_us=timings[best] * 1e6,
                             best=best, sweep_us={str(config): seconds * 1e6 for config, seconds in timings.items()})
                line += f"{entry['model_call_us']:>9.2f}{entry['best_us']:>9.2f} {best}"
            report.append(entry)
            rows.append(line)
            del weights
            print(line, flush=True)
            if args.sweep and args.fp8 == "block":  # shape by shape: a run cut short keeps what it measured
                write_gemv_table([entry], args.table)
    out = args.out or Path(f"bench/out/gemv{'_fp8_' + args.fp8 if args.fp8 else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("model layer      N      K  tiles       cuBLAS us  gemv us  cuBLAS TB/s  gemv TB/s"
          + ("  model call us (fusions in), its best us (block_n, block_k, warps)"
             if args.sweep and not args.fp8 else "")
          + ("  model call us (fusions in), its best us, the 16-bit call us, (block_n, block_k, warps, conversion,"
             " sum once, past L1, x by thread)" if args.sweep and args.fp8 else ""))
    print("\n".join(rows))
    layer = [e for e in report if e["layer"] != "lm_head"]
    total = {model: (sum(e["cublas_us"] for e in layer if e["model"] == model),
                     sum(e["gemv_us"] for e in layer if e["model"] == model)) for model in args.models}
    for model, (cublas, ours) in total.items():
        print(f"{model}: one layer's projections {cublas:.1f} us with cuBLAS, {ours:.1f} us with gemv")


def compare_fused(models: list[str]) -> list[dict]:
    """Microseconds per separate and fused call of each projection with a fusion, per model and layer:
    the norm before q/k/v and gate/up, then the SiLU-and-mul after gate/up (on top of the norm)."""
    from nanoserve_model.activation import silu_and_mul
    from nanoserve_model.norm import add_rms_norm
    report = []
    print("model layer      N      K  fusion     separate us  fused us  saved us")
    cases = (("qkv", "rms_norm"), ("gate_up", "rms_norm"), ("gate_up", "silu_mul"))
    for model in models:
        for (name, n, k), prologue in ((shape, fusion) for case, fusion in cases for shape in SHAPES[model]
                                       if shape[0] == case):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            x, residual = torch.randn(2, 1, k, device="cuda", dtype=torch.bfloat16).unbind(0)
            norm = (1 + 0.3 * torch.randn(k, device="cuda")).bfloat16()
            if prologue == "rms_norm":
                separate, fused = ((lambda w: gemv(add_rms_norm(x, residual, norm, 1e-6)[0], w)),
                                   (lambda w: rms_norm_gemv(x, residual, norm, 1e-6, w)[0]))
            else:
                separate, fused = ((lambda w: silu_and_mul(rms_norm_gemv(x, residual, norm, 1e-6, w)[0])),
                                   (lambda w: rms_norm_gemv(x, residual, norm, 1e-6, w, silu_mul=True)[0]))
            weights = weight_copies(w)
            entry = dict(model=model, layer=name, n=n, k=k, prologue=prologue,
                         separate_us=time_per_call(separate, weights) * 1e6,
                         fused_us=time_per_call(fused, weights) * 1e6)
            report.append(entry)
            del weights
            print(f"{model:<5}{name:<8}{n:>7}{k:>7}  {prologue:<9}{entry['separate_us']:>12.2f}"
                  f"{entry['fused_us']:>10.2f}{entry['separate_us'] - entry['fused_us']:>10.2f}", flush=True)
    for model in models:
        saved = sum(e["separate_us"] - e["fused_us"] for e in report if e["model"] == model)
        print(f"{model}: {saved:.1f} us saved a layer")
    return report


def triton_pow2(value: int) -> int:
    return 1 << (value - 1).bit_length()


if __name__ == "__main__":
    main()
