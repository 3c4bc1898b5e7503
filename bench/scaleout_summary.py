"""The summary of bench/gpu_scaleout.sh's runs: reads each run's bench/serve.py JSON from the folder,
writes summary.json and summary.md beside them, and prints the table.

    python3 bench/scaleout_summary.py OUT_DIR NUM_GPUS
"""
import datetime
import json
import re
import sys
from pathlib import Path

FINISHED = re.compile(r"request finished .* prompt_tokens=(\d+) completion_tokens=\d+ cached_tokens=(\d+) ")


def first_rate(folder: Path, name: str) -> dict | None:
    """The one rate's summary of run `name`, None when the run did not happen or failed to write."""
    path = folder / f"{name}.json"
    if not path.exists():
        return None
    return next(iter(json.loads(path.read_text())["rates"].values()))


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def field(run: dict | None, *keys: str) -> float | None:
    for key in keys:
        if run is None:
            return None
        run = run.get(key)
    return run


def summarize(folder: Path, gpus: int) -> dict:
    run = {name.stem: first_rate(folder, name.stem) for name in folder.glob("*.json") if name.stem != "summary"}
    one, many = run.get("dp1_small"), run.get(f"dp{gpus}_small")
    summary = {
        "date": datetime.date.today().isoformat(),
        "device": (folder / "gpus.txt").read_text().strip().replace("\n", "; ") if (folder / "gpus.txt").exists()
        else "", "command": "bench/gpu_scaleout.sh", "gpus": gpus,
        "scale_out": {"one_replica_direct_tok_s": field(one, "output_tok_per_s"),
                      f"{gpus}_replicas_smg_tok_s": field(many, "output_tok_per_s"),
                      "ratio_to_n_x_one": ratio(field(many, "output_tok_per_s"),
                                                gpus * (field(one, "output_tok_per_s") or 0)),
                      "target": 0.95},
        "router_added_ttft_ms": router_added_ttft(run),
        "dp2_vs_tp2": {shape: {"dp2_smg_tok_s": field(run.get(f"dp2_{shape}"), "output_tok_per_s"),
                               "tp2_direct_tok_s": field(run.get(f"tp2_{shape}"), "output_tok_per_s"),
                               "dp2_over_tp2": ratio(field(run.get(f"dp2_{shape}"), "output_tok_per_s"),
                                                     field(run.get(f"tp2_{shape}"), "output_tok_per_s"))}
                       for shape in ("small", "big")},
        "tenants": {policy: _tenants(run.get(f"tenants_{policy}"), folder / f"tenants_{policy}.server.log")
                    for policy in ("round_robin", "cache_aware")},
        "failed_requests": {name: r["failed"] for name, r in run.items() if r and r["failed"]},
        "requests_per_replica": {name: r["requests_per_replica"] for name, r in sorted(run.items())
                                 if r and "requests_per_replica" in r},
        # the busiest client process's CPU seconds per second: near 1, the client set the pace
        "client_cpu_per_wall": {name: {"processes": r["client"]["processes"], "max": max(r["client"]["cpu_per_wall"])}
                                for name, r in sorted(run.items()) if r and "client" in r},
    }
    rr, ca = summary["tenants"]["round_robin"], summary["tenants"]["cache_aware"]
    summary["tenants"]["cache_aware_over_round_robin"] = {
        "output_tok_s": ratio(field(ca, "output_tok_s"), field(rr, "output_tok_s")),
        "ttft_p90": ratio(field(ca, "ttft_p90_ms"), field(rr, "ttft_p90_ms"))}
    if summary["dp2_vs_tp2"]["small"]["dp2_smg_tok_s"] is None and gpus == 2:  # the DP2 run is the N-replica one
        summary["dp2_vs_tp2"]["small"]["dp2_smg_tok_s"] = field(many, "output_tok_per_s")
        summary["dp2_vs_tp2"]["small"]["dp2_over_tp2"] = ratio(field(many, "output_tok_per_s"),
                                                               field(run.get("tp2_small"), "output_tok_per_s"))
    return summary


def router_added_ttft(run: dict) -> dict | None:
    """TTFT through SMG minus straight to replica 0, whose runs came before and after it (their mean),
    one request at a time; None unless all three ran."""
    router, direct = run.get("ttft_router"), [run.get("ttft_replica"), run.get("ttft_replica_again")]
    if router is None or None in direct:
        return None
    return {p: field(router, "ttft_ms", p) - sum(field(d, "ttft_ms", p) for d in direct) / 2 for p in ("p50", "p90")}


def _tenants(run: dict | None, server_log: Path) -> dict | None:
    if run is None:
        return None
    return {"output_tok_s": run["output_tok_per_s"], "ttft_p50_ms": field(run, "ttft_ms", "p50"),
            "ttft_p90_ms": field(run, "ttft_ms", "p90"), "completed": run["completed"], "failed": run["failed"],
            "prefix_hit_rate": prefix_hit_rate(server_log)}


def prefix_hit_rate(server_log: Path) -> float | None:
    """Prompt tokens served from the prefix cache over all prompt tokens, from every replica's "request
    finished" lines (the warmup's included): GetStats would give one replica's only."""
    if not server_log.exists():
        return None
    finished = [(int(prompt), int(cached)) for prompt, cached in FINISHED.findall(server_log.read_text())]
    return ratio(sum(cached for _, cached in finished), sum(prompt for prompt, _ in finished))


def markdown(s: dict) -> str:
    def num(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    so, t = s["scale_out"], s["tenants"]
    replicas = so[f"{s['gpus']}_replicas_smg_tok_s"]
    lines = [f"# Scale-out, {s['date']}, {s['device']} ({s['gpus']} GPUs), `{s['command']}`", "",
             "| measure | value |", "| --- | --- |",
             f"| one replica direct, output tok/s | {num(so['one_replica_direct_tok_s'], 0)} |",
             f"| {s['gpus']} replicas through SMG, output tok/s | {num(replicas, 0)} |",
             f"| ... over {s['gpus']} x one replica (target >= 0.95) | {num(so['ratio_to_n_x_one'])} |"]
    if s["router_added_ttft_ms"]:
        added = s["router_added_ttft_ms"]
        lines.append(f"| router's added TTFT, one request at a time, p50 / p90 ms | {num(added['p50'])} / "
                     f"{num(added['p90'])} |")
    for shape, row in s["dp2_vs_tp2"].items():
        name = "0.6B" if shape == "small" else "8B"
        lines.append(f"| {name}: DP2 via SMG / TP2 direct, output tok/s | {num(row['dp2_smg_tok_s'], 0)} / "
                     f"{num(row['tp2_direct_tok_s'], 0)} ({num(row['dp2_over_tp2'])}x) |")
    for policy in ("round_robin", "cache_aware"):
        if t[policy]:
            lines.append(f"| tenants, {policy}: output tok/s, TTFT p50 / p90 ms, prefix hit rate "
                         f"| {num(t[policy]['output_tok_s'], 0)}, {num(t[policy]['ttft_p50_ms'], 0)} / "
                         f"{num(t[policy]['ttft_p90_ms'], 0)}, {num(t[policy]['prefix_hit_rate'])} |")
    ratios = t["cache_aware_over_round_robin"]
    lines.append(f"| tenants, cache-aware over round robin: output tok/s (target >= 1.6), TTFT p90 (target <= 0.1) "
                 f"| {num(ratios['output_tok_s'])}, {num(ratios['ttft_p90'])} |")
    lines.append(f"| failed requests | {s['failed_requests'] or 'none'} |")
    for name, counts in s["requests_per_replica"].items():
        lines.append(f"| {name}: requests per replica | {' / '.join(map(str, counts))} |")
    for name, client in s["client_cpu_per_wall"].items():
        lines.append(f"| {name}: client processes, busiest one's CPU s per s | {client['processes']}, "
                     f"{num(client['max'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    folder, gpus = Path(sys.argv[1]), int(sys.argv[2])
    summary = summarize(folder, gpus)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    text = markdown(summary)
    (folder / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
