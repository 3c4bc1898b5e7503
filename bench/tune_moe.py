"""Tunes the fused MoE GEMMs' launch configs for one layer shape on this GPU and writes them where
nanoserve_kernels/moe_launch.py reads them (moe_configs/E{experts}_N{width}_{GPU}.json), then compares
the whole layer (routing, sort-and-pad, both GEMMs, the sum; replayed from a CUDA graph, as decode runs
it, from the router's logits) under the tuned configs, the untuned defaults, and a per-expert loop of cuBLAS
GEMMs (the routing done).

Per batch size: for each BLOCK_M (the sort's, which both GEMMs share) the fastest gate/up and down tiles
of a small grid, then the BLOCK_M whose pair is fastest. Random router logits spread the tokens evenly
over the experts, as random (dummy) weights do; a trained router is more skewed.

    python3 bench/tune_moe.py                                  # Qwen3-30B-A3B, one rank
    python3 bench/tune_moe.py --width 384 --batches 1 8 64    # its expert width over two ranks
    python3 bench/tune_moe.py --config-dir $OUT/moe_configs    # write elsewhere (the repo's: default)
    python3 bench/tune_moe.py --fp8                            # e4m3 experts, 128 x 128 blocks (..._fp8.json)

With --fp8 the experts are e4m3 with 128 x 128 block scales (weight-only GEMMs: BLOCK_K up to 128, one
scale block a step); the cuBLAS loop runs on the bf16 weights they were quantized from.
"""
import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

import triton.testing  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from nanoserve_kernels.fused_moe import fused_moe  # noqa: E402
from nanoserve_kernels.moe_launch import CONFIG_DIR, config_name, default_config  # noqa: E402
from nanoserve_kernels.moe_reference import quantize_experts  # noqa: E402
from nanoserve_kernels.triton_moe_align import align_block_size  # noqa: E402
from nanoserve_kernels.triton_moe_gemm import grouped_gemm  # noqa: E402
from nanoserve_kernels.triton_moe_routing import route  # noqa: E402

# The grid searched per BLOCK_M: 16-row blocks (decode) read weights with 4 warps and want wide K tiles;
# taller blocks compute more and group their row blocks for the L2 (GROUP_M).
SHORT_TILES = dict(BLOCK_N=(32, 64, 128), BLOCK_K=(64, 128, 256), GROUP_M=(1,), num_warps=(4,), num_stages=(3, 4))
TALL_TILES = dict(BLOCK_N=(64, 128), BLOCK_K=(64, 128), GROUP_M=(8,), num_warps=(4, 8), num_stages=(3, 4))


def block_ms(pairs: int) -> tuple[int, ...]:
    """BLOCK_M worth trying: short blocks while most experts get a pair or two, taller ones above."""
    return (16,) if pairs <= 128 else (16, 32) if pairs <= 1024 else (32, 64) if pairs <= 8192 else (64, 128)


FP8_BLOCK = (128, 128)


def tile_grid(block_m: int, fp8: bool) -> list[dict]:
    """The grid at this BLOCK_M; for e4m3 experts only K steps within one 128-column scale block."""
    tiles = SHORT_TILES if block_m == 16 else TALL_TILES
    grid = [dict(zip(tiles, values)) for values in itertools.product(*tiles.values())]
    return [tile for tile in grid if not fp8 or tile["BLOCK_K"] <= FP8_BLOCK[1]]


def time_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=20) * 1e3


def graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3


class Layer:
    def __init__(self, tokens: int, experts: int, top_k: int, hidden: int, width: int, dtype: torch.dtype,
                 fp8: bool = False):
        self.hidden = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
        self.gate_up = torch.randn(experts, 2 * width, hidden, device="cuda", dtype=dtype) * 0.02
        self.down = torch.randn(experts, hidden, width, device="cuda", dtype=dtype) * 0.02
        self.fp8 = fp8
        self.scales = {}  # gate_up_scales, down_scales of e4m3 experts
        if fp8:  # the fused GEMMs read e4m3 copies; the cuBLAS loop keeps the bf16 weights
            self.gate_up_fp8, self.scales["gate_up_scales"] = quantize_experts(self.gate_up, FP8_BLOCK)
            self.down_fp8, self.scales["down_scales"] = quantize_experts(self.down, FP8_BLOCK)
        self.router_logits = torch.randn(tokens, experts, device="cuda", dtype=dtype)
        self.weights, self.ids = route(self.router_logits, top_k, True)
        self.activation = torch.empty(tokens * top_k, width, device="cuda", dtype=dtype)
        self.partial = torch.empty(tokens * top_k, hidden, device="cuda", dtype=dtype)

    def best_tiles(self, block_m: int) -> tuple[float, dict]:
        """The fastest (gate/up + down) tiles at this BLOCK_M: (microseconds, config)."""
        sort = align_block_size(self.ids, self.gate_up.shape[0], block_m)
        blocks = (*sort, self.ids.numel())
        top_k = self.ids.shape[1]
        gate_up, down = self.experts()
        runs = {"gate_up": lambda tiles: grouped_gemm(self.hidden, gate_up, self.activation, *blocks, top_k, tiles,
                                                       silu_mul=True, scales=self.scales.get("gate_up_scales")),
                "down": lambda tiles: grouped_gemm(self.activation, down, self.partial, *blocks, 1, tiles,
                                                   pair_weights=self.weights.flatten(),
                                                   scales=self.scales.get("down_scales"))}
        total, config = 0.0, dict(BLOCK_M=block_m)
        for gemm, run in runs.items():
            timed = []
            for tiles in tile_grid(block_m, self.fp8):
                try:
                    timed.append((time_us(lambda: run(dict(tiles, BLOCK_M=block_m))), tiles))
                except OutOfResources:
                    continue
            best_us, config[gemm] = min(timed, key=lambda item: item[0])
            total += best_us
        return total, config

    def expert_loop(self) -> torch.Tensor:
        """The unfused baseline: each expert's tokens gathered and run through cuBLAS GEMMs."""
        out = torch.zeros(self.hidden.shape, dtype=torch.float32, device="cuda")
        for expert in self.ids.unique().tolist():
            token, slot = torch.where(self.ids == expert)
            gate, up = F.linear(self.hidden[token], self.gate_up[expert]).chunk(2, dim=-1)
            out.index_add_(0, token, F.linear(F.silu(gate) * up, self.down[expert]).float()
                           * self.weights[token, slot, None])
        return out.to(self.hidden.dtype)

    def experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) as the fused GEMMs read them."""
        return (self.gate_up_fp8, self.down_fp8) if self.fp8 else (self.gate_up, self.down)

    def layer_us(self, config: dict) -> float:
        """The layer as a step runs it, from the router's logits."""
        return graph_us(lambda: fused_moe(self.hidden, *self.experts(), self.router_logits, self.ids.shape[1], True,
                                          config, **self.scales))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768, help="each expert's intermediate size on one rank")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096])
    p.add_argument("--fp8", action="store_true", help="e4m3 experts with 128 x 128 block scales (weight-only)")
    p.add_argument("--config-dir", type=Path, default=CONFIG_DIR)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "tune_moe.json")
    args = p.parse_args()
    device = torch.cuda.get_device_name()
    configs, rows = {}, []
    dtype = "float8_e4m3fn, 128x128 blocks, weight-only" if args.fp8 else "bfloat16"
    print(f"{device}: {args.experts} experts top-{args.top_k}, hidden {args.hidden}, width {args.width}, {dtype}")
    print(f"{'tokens':>6} {'tuned us':>9} {'default us':>10} {'loop us':>8}  BLOCK_M  (tuning s)")
    for tokens in args.batches:
        started = time.perf_counter()
        layer = Layer(tokens, args.experts, args.top_k, args.hidden, args.width, torch.bfloat16, args.fp8)
        _, configs[tokens] = min((layer.best_tiles(m) for m in block_ms(tokens * args.top_k)), key=lambda t: t[0])
        row = dict(tokens=tokens, tuned_us=layer.layer_us(configs[tokens]),
                   default_us=layer.layer_us(default_config(tokens, args.experts)),
                   loop_us=time_us(layer.expert_loop), config=configs[tokens])
        rows.append(row)
        print(f"{tokens:>6} {row['tuned_us']:>9.1f} {row['default_us']:>10.1f} {row['loop_us']:>8.1f}  "
              f"{configs[tokens]['BLOCK_M']:>7}  ({time.perf_counter() - started:.0f})", flush=True)
    args.config_dir.mkdir(parents=True, exist_ok=True)
    path = args.config_dir / config_name(args.experts, args.width, device, args.fp8)
    path.write_text(json.dumps(dict(device=device, experts=args.experts, width=args.width, hidden=args.hidden,
                                    top_k=args.top_k, dtype=dtype, date=time.strftime("%Y-%m-%d"),
                                    command=" ".join(sys.argv), configs=configs), indent=1) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(device=device, dtype=dtype, rows=rows), indent=1) + "\n")
    print(f"wrote {path} and {args.out}")


if __name__ == "__main__":
    main()
