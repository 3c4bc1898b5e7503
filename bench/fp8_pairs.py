"""FP8 weights against bf16 on one GPU, like for like (issue 38's targets): each configuration is one
`nanoserve up` on dummy weights with the triton attention backend, measured by bench/latency.py's batch-1
part (TTFT at 512 tokens, ITL over 128 tokens) and then bench/throughput.py's DESIGN workload against the
same server, one configuration after the other:

    8B bf16, 8B FP8 (Qwen block), 0.6B bf16, 0.6B FP8, 8B FP8 + FP8 KV cache (throughput only).

A configuration that would start after --budget-s is skipped and says so. Each part's JSON goes to --out-dir
(latency_<name>.json, throughput_<name>.json, the server's log); the summary (pairs.json and the table
printed last) gives the FP8/bf16 ratios per shape.

    python3 bench/fp8_pairs.py [--budget-s 300] [--out-dir bench/out] [--only 8b_bf16 8b_fp8 ...]
"""
import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto"), str(REPO / "bench")]

import latency  # noqa: E402
import throughput  # noqa: E402
from nanoserve_cli.launcher import free_port, stop_all, wait_serving  # noqa: E402

SERVER_FLAGS = ["--load-format", "dummy", "--attention-backend", "triton", "--max-model-len", "4096"]
# name -> (model directory under .cache, more flags, parts)
CONFIGS = {
    "8b_bf16": ("qwen3-8b-dummy", [], ("latency", "throughput")),
    "8b_fp8": ("qwen3-8b-fp8-dummy", [], ("latency", "throughput")),
    "06b_bf16": ("qwen3-0.6b-dummy", [], ("latency", "throughput")),
    "06b_fp8": ("qwen3-0.6b-fp8-dummy", [], ("latency", "throughput")),
    "8b_fp8_kvfp8": ("qwen3-8b-fp8-dummy", ["--kv-cache-dtype", "fp8"], ("throughput",)),
}
LATENCY_ARGS = argparse.Namespace(prompt_lens=[512], repeats=5, batches=[1], itl_prompt_len=512, itl_tokens=128)


def serve(name: str, out_dir: Path) -> dict:
    """Starts the configuration's server, runs its parts against it, stops it; the parts' results."""
    model, flags, parts = CONFIGS[name]
    port = free_port()
    log = open(out_dir / f"server_{name}.log", "w")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve_cli", "up", "--model", str(REPO / ".cache" / model),
                             "--port", str(port), "--worker-base-port", str(free_port()), *SERVER_FLAGS, *flags],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    address, result = f"127.0.0.1:{port}", {}
    try:
        started = time.monotonic()
        wait_serving(address, [proc], timeout=300)
        result["start_s"] = time.monotonic() - started
        if "latency" in parts:
            result["latency"] = asyncio.run(latency.measure(address, LATENCY_ARGS))
            (out_dir / f"latency_{name}.json").write_text(json.dumps(result["latency"], indent=2))
        if "throughput" in parts:
            jobs = throughput.workload(*throughput.WORKLOADS["design"])
            result["throughput"] = asyncio.run(throughput.drive(address, jobs))
            (out_dir / f"throughput_{name}.json").write_text(json.dumps(result["throughput"], indent=2))
    finally:
        stop_all([proc])
        log.close()
    return result


def summary(results: dict) -> list[str]:
    """One line per configuration, and the FP8/bf16 ratios of each shape."""
    lines = [f"{'config':14s} {'start s':>8s} {'ITL p50 ms':>11s} {'TTFT@512 ms':>12s} {'tok/s':>9s} "
             f"{'KV blocks':>10s} {'decode ms/step':>15s} {'prefill tok/s':>14s}"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name:14s} {r['error']}")
            continue
        itl = r.get("latency", {}).get("itl", {}).get("1", {}).get("p50")
        ttft = r.get("latency", {}).get("ttft", {}).get("512", {}).get("p50")
        tput = r.get("throughput", {})
        lines.append(f"{name:14s} {r['start_s']:8.1f} {itl or float('nan'):11.3f} {ttft or float('nan'):12.2f} "
                     f"{tput.get('tok_per_s', float('nan')):9.0f} {tput.get('kv_blocks', 0):10d} "
                     f"{tput.get('decode_step_ms', float('nan')):15.2f} "
                     f"{tput.get('prefill_tok_per_s', float('nan')):14.0f}")
    for shape in ("8b", "06b"):
        base = results.get(f"{shape}_bf16", {})
        for fp8 in (f"{shape}_fp8", f"{shape}_fp8_kvfp8"):
            other = results.get(fp8, {})
            ratios = []
            for part, key, field in (("latency", "itl", "1"), ("latency", "ttft", "512")):
                a, b = (x.get(part, {}).get(key, {}).get(field, {}).get("p50") for x in (base, other))
                if a and b:
                    ratios.append(f"{key} {b / a:.3f}x")
            a, b = (x.get("throughput", {}).get("tok_per_s") for x in (base, other))
            if a and b:
                ratios.append(f"throughput {b / a:.3f}x")
            if ratios:
                lines.append(f"{fp8} / {shape}_bf16: " + ", ".join(ratios))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=600.0, help="start no configuration after this long")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "out")
    p.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout stops the running server too (finally)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    deadline, results = time.monotonic() + args.budget_s, {}
    for name in args.only:
        if time.monotonic() > deadline:
            results[name] = {"error": "not run: the budget was spent"}
            continue
        try:
            results[name] = serve(name, args.out_dir)
        except Exception as err:  # a server that did not start: the others still run
            results[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
        print(summary({name: results[name]})[-1], flush=True)
    (args.out_dir / "pairs.json").write_text(json.dumps(results, indent=2))
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
