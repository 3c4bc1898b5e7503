"""Paged attention kernels: our Triton prefill and decode against flash-attn (when it imports) on
the same paged shapes (Qwen3-0.6B: 16 query heads, 8 KV heads, head_dim 128, bf16, blocks of 256),
and decode bytes/s against the measured device-to-device copy rate; Triton decode over an FP8 cache
(--kv-cache-dtype fp8: e4m3 values and their float32 scales are the bytes read) against the same
decode over the bf16 cache it dequantizes to; a ragged decode batch with its sequences started in
row order and longest first (the worker's order). Prints a table, writes JSON.

    PYTHONPATH=.:proto python bench/attention.py [--out bench/out/attention.json]
    PYTHONPATH=.:proto python bench/attention.py --sweep-fp8   # FP8 decode launch configs, % of copy
"""
import argparse
import datetime
import functools
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch
import triton

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from nanoserve_kernels import flash_attn_backend, kv_quant, triton_decode, triton_prefill  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 16, 8, 128, 256, torch.bfloat16
SCALE = HEAD_DIM ** -0.5
# Enough distinct cache data per timed call that repeated calls do not run from the 50 MB L2.
MIN_ROTATED_BYTES = 512 * 2**20
DECODE_SHAPES = [(256, 1024), (64, 1024), (16, 1024), (1, 1024), (8, 8192)]  # (batch, context)
FP8_DECODE_SHAPES = [(256, 1024), (8, 8192)]


def ragged_lengths(count: int, longest: int = 1024) -> list[int]:
    """Prompt lengths drawn as the throughput workload draws them (uniform in [100, 1024])."""
    rng = random.Random(0)
    return [rng.randint(100, longest) for _ in range(count)]


PREFILL_SHAPES = {  # name: (new tokens per sequence, cached tokens per sequence after the store)
    "16 x 1024 new": ([1024] * 16, [1024] * 16),
    "16 x 1024 new + 1024 cached": ([1024] * 16, [2048] * 16),
    "16 x U[100,1024] new": (ragged_lengths(16), ragged_lengths(16)),
}


def median_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy."""
    src = torch.randint(0, 2**30, (2**28,), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / (median_ms(lambda: dst.copy_(src)) * 1e-3)


def paged_sets(context_lens: list[int], copies: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One cache pool holding `copies` disjoint, shuffled block sets for a batch of sequences;
    returns (k_cache, v_cache, block_tables [copies, batch, max_blocks])."""
    counts = [triton.cdiv(length, BLOCK_SIZE) for length in context_lens]
    width = max(counts)
    num_blocks = copies * len(counts) * width
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    tables = torch.randperm(num_blocks, device="cuda").int().view(copies, len(counts), width)
    for seq, count in enumerate(counts):
        tables[:, seq, count:] = -1
    return k_cache, v_cache, tables


def kv_bytes(context_lens: list[int], cache_dtype: torch.dtype = DTYPE) -> int:
    """K and V bytes of the contexts, FP8 scales included."""
    return 2 * sum(context_lens) * KV_HEADS * kv_quant.bytes_per_row(cache_dtype, HEAD_DIM)


def decode_inputs(batch: int, context: int, lengths: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """q [copies, batch, heads, head_dim], k_cache, v_cache, context_lens, tables [copies, ...]:
    enough copies of the batch's blocks that rotating through them reads the cache from HBM. Every
    context is `context` tokens long, or `lengths` gives them."""
    lengths = lengths or [context] * batch
    copies = triton.cdiv(MIN_ROTATED_BYTES, kv_bytes(lengths))
    k_cache, v_cache, tables = paged_sets(lengths, copies)
    q = torch.randn(copies, batch, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    return q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32, device="cuda"), tables


def time_decode(decode: Callable, inputs: tuple[torch.Tensor, ...]) -> tuple[float, torch.Tensor]:
    """Milliseconds per call, replaying a CUDA graph (as the engine does) of one call per copy."""
    q, k_cache, v_cache, context_lens, tables = inputs
    decode(q[0], k_cache, v_cache, context_lens, tables[0], SCALE)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [decode(q[i], k_cache, v_cache, context_lens, tables[i], SCALE) for i in range(len(q))]
    return median_ms(graph.replay) / len(q), outs[0]


def prefill_inputs(new_lens: list[int], context_lens: list[int]) -> tuple:
    k_cache, v_cache, tables = paged_sets(context_lens, 1)
    q = torch.randn(sum(new_lens), HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    cu_seqlens_q = torch.tensor([0, *new_lens], device="cuda").cumsum(0, dtype=torch.int32)
    cu_seqlens_k = torch.tensor([0, *context_lens], device="cuda").cumsum(0, dtype=torch.int32)
    return (q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max(new_lens), max(context_lens), tables[0],
            SCALE)


def time_prefill(prefill: Callable, inputs: tuple) -> tuple[float, torch.Tensor]:
    """Milliseconds per eager call (prefill steps are not captured in graphs)."""
    return median_ms(lambda: prefill(*inputs)), prefill(*inputs)


def prefill_flops(new_lens: list[int], context_lens: list[int]) -> int:
    """Causal attention: query i of n new tokens over L cached sees L - n + i + 1 keys; QK^T and
    PV cost 2 * head_dim FLOPs per (query, key, head) each."""
    pairs = sum(n * (length - n) + n * (n + 1) // 2 for n, length in zip(new_lens, context_lens))
    return 4 * pairs * HEAD_DIM * HEADS


def relative_difference(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def compare(name: str, timer: Callable, inputs: tuple, triton_fn: Callable, flash_fn: Callable) -> dict:
    """Times both backends on the same inputs; their outputs' relative difference checks that
    the rows compare the same computation."""
    triton_ms, triton_out = timer(triton_fn, inputs)
    row = dict(case=name, triton_ms=triton_ms)
    if flash_attn_backend.AVAILABLE:
        flash_ms, flash_out = timer(flash_fn, inputs)
        row.update(flash_attn_ms=flash_ms, triton_over_flash_attn=triton_ms / flash_ms,
                   relative_difference=relative_difference(triton_out, flash_out))
    return row


def fp8_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 cache as --kv-cache-dtype fp8 stores it: e4m3 values, scales [blocks, kv heads, block]."""
    values, scales = kv_quant.quantize(cache)
    return values, scales.transpose(1, 2).contiguous()


def decode_rate(ms: float, lengths: list[int], cache_dtype: torch.dtype, copy_rate: float) -> dict:
    """What a decode over contexts `lengths` moves (K and V once, FP8 scales included, then q and out),
    at what rate, and as a share of the copy rate."""
    moved = kv_bytes(lengths, cache_dtype) + 2 * len(lengths) * HEADS * HEAD_DIM * DTYPE.itemsize
    return dict(bytes=moved, triton_bytes_per_s=moved / (ms * 1e-3),
                triton_fraction_of_copy=moved / (ms * 1e-3) / copy_rate)


def fp8_decode_row(batch: int, context: int, copy_rate: float) -> dict:
    """Triton decode over an FP8 cache, and over the bf16 cache holding the values it dequantizes
    to (their outputs' relative difference checks that both compute the same attention)."""
    q, k_cache, v_cache, context_lens, tables = decode_inputs(batch, context)
    (k8, k_scale), (v8, v_scale) = fp8_cache(k_cache), fp8_cache(v_cache)
    k_cache, v_cache = (kv_quant.dequantize(values, kv_quant.slot_major(scales)).to(DTYPE)
                        for values, scales in ((k8, k_scale), (v8, v_scale)))
    fp8_decode = functools.partial(triton_decode.paged_decode, k_scale=k_scale, v_scale=v_scale)
    fp8_ms, fp8_out = time_decode(fp8_decode, (q, k8, v8, context_lens, tables))
    bf16_ms, bf16_out = time_decode(triton_decode.paged_decode, (q, k_cache, v_cache, context_lens, tables))
    return dict(case=f"decode {batch} x {context} fp8 KV", triton_ms=fp8_ms, bf16_cache_ms=bf16_ms,
                fp8_over_bf16=fp8_ms / bf16_ms, relative_difference=relative_difference(fp8_out, bf16_out),
                **decode_rate(fp8_ms, [context] * batch, kv_quant.FP8_DTYPE, copy_rate))


def ragged_decode_rows(copy_rate: float) -> list[dict]:
    """Triton decode of 256 contexts uniform in [100, 2,000] (bf16, then FP8), the sequences started
    in row order, then longest first as the worker orders them (`order`)."""
    lengths = ragged_lengths(256, 2000)
    inputs = decode_inputs(len(lengths), 0, lengths)
    q, k_cache, v_cache, context_lens, tables = inputs
    (k8, k_scale), (v8, v_scale) = fp8_cache(k_cache), fp8_cache(v_cache)
    order = torch.argsort(context_lens, descending=True, stable=True).to(torch.int32)
    rows = []
    for cache_dtype, scales, cache in ((DTYPE, {}, inputs), (kv_quant.FP8_DTYPE, dict(k_scale=k_scale, v_scale=v_scale),
                                                                (q, k8, v8, context_lens, tables))):
        for started, extra in (("in row order", {}), ("longest first", dict(order=order))):
            decode = functools.partial(triton_decode.paged_decode, **scales, **extra)
            ms, _ = time_decode(decode, cache)
            kind = " fp8 KV" if scales else ""
            rows.append(dict(case=f"decode 256 x U[100,2000]{kind}, {started}", triton_ms=ms,
                             **decode_rate(ms, lengths, cache_dtype, copy_rate)))
    return rows


def run() -> dict:
    copy_rate = copy_bandwidth()
    decode_rows, prefill_rows = [], []
    for batch, context in DECODE_SHAPES:
        row = compare(f"decode {batch} x {context}", time_decode, decode_inputs(batch, context),
                      triton_decode.paged_decode, flash_attn_backend.paged_decode)
        row.update(decode_rate(row["triton_ms"], [context] * batch, DTYPE, copy_rate))
        decode_rows.append(row)
    decode_rows += [fp8_decode_row(batch, context, copy_rate) for batch, context in FP8_DECODE_SHAPES]
    decode_rows += ragged_decode_rows(copy_rate)
    for name, (new_lens, context_lens) in PREFILL_SHAPES.items():
        row = compare(f"prefill {name}", time_prefill, prefill_inputs(new_lens, context_lens),
                      triton_prefill.paged_prefill, flash_attn_backend.paged_prefill)
        row.update(flops=prefill_flops(new_lens, context_lens))
        row["triton_flops_per_s"] = row["flops"] / (row["triton_ms"] * 1e-3)
        prefill_rows.append(row)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or None  # None: a copy of the tree, not a checkout
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=commit, copy_bytes_per_s=copy_rate, decode=decode_rows, prefill=prefill_rows)


def print_table(result: dict) -> None:
    print(f"{result['device']}, copy {result['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write)")
    print("(fp8 KV rows compare with triton over the bf16 cache of the same values, not flash-attn)")
    print(f"{'case':48} {'triton ms':>10} {'flash ms':>9} {'ratio':>6} {'diff':>7} {'rate':>12} {'% copy':>7}")
    for row in result["decode"] + result["prefill"]:
        flash = f"{'-':>9} {'-':>6} {'-':>7}"
        if "flash_attn_ms" in row:
            flash = (f"{row['flash_attn_ms']:9.4f} {row['triton_over_flash_attn']:6.2f} "
                     f"{row['relative_difference']:7.1e}")
        elif "bf16_cache_ms" in row:
            flash = f"{row['bf16_cache_ms']:9.4f} {row['fp8_over_bf16']:6.2f} {row['relative_difference']:7.1e}"
        if "triton_bytes_per_s" in row:
            rate = f"{row['triton_bytes_per_s'] / 1e12:8.2f} TB/s"
            share = f"{100 * row['triton_fraction_of_copy']:6.1f}%"
        else:
            rate, share = f"{row['triton_flops_per_s'] / 1e12:6.0f} TFLOP/s", f"{'-':>7}"
        print(f"{row['case']:48} {row['triton_ms']:10.4f} {flash} {rate:>12} {share}")


def sweep_fp8() -> dict:
    """FP8 decode at each launch config (key tile, warps, stages) on the FP8 shapes: which one
    triton_decode.FP8_LAUNCH should be."""
    copy_rate, rows = copy_bandwidth(), []
    chosen = dict(triton_decode.FP8_LAUNCH)
    for block_n, warps, stages in itertools.product((64, 128, 256), (4, 8), (2, 3, 4)):
        triton_decode.FP8_LAUNCH.update(BLOCK_N=block_n, num_warps=warps, num_stages=stages)
        for batch, context in FP8_DECODE_SHAPES:
            row = fp8_decode_row(batch, context, copy_rate)
            rows.append(dict(block_n=block_n, num_warps=warps, num_stages=stages, **row))
            print(f"BLOCK_N {block_n:3} warps {warps} stages {stages}  {row['case']:28} {row['triton_ms']:8.4f} ms "
                  f"{100 * row['triton_fraction_of_copy']:5.1f}% of copy  fp8/bf16 {row['fp8_over_bf16']:.2f}",
                  flush=True)
    triton_decode.FP8_LAUNCH.update(chosen)
    return dict(device=torch.cuda.get_device_name(), copy_bytes_per_s=copy_rate, sweep=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench/out/attention.json")
    parser.add_argument("--sweep-fp8", action="store_true", help="time FP8 decode at every launch config instead")
    args = parser.parse_args()
    if args.sweep_fp8:
        result = sweep_fp8()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_name("attention-fp8-sweep.json").write_text(json.dumps(result, indent=2))
        return
    result = run()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(result)


if __name__ == "__main__":
    main()
