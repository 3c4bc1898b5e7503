"""The summary of bench/gpu_scaleout.sh's runs: reads each run's bench/serve.py (and
bench/router_overhead.py) JSON from the folder, writes summary.json and summary.md beside them, and
prints the table.

    python3 bench/scaleout_summary.py OUT_DIR NUM_GPUS
"""
import datetime
import json
import sys
from pathlib import Path


def report(folder: Path, name: str) -> dict | None:
    """Run `name`'s JSON, None when the run did not happen or failed to write."""
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def rates(folder: Path, name: str) -> dict[str, dict] | None:
    """Run `name`'s summaries by rate (bench/serve.py's)."""
    run = report(folder, name)
    return run["rates"] if run else None


def first_rate(folder: Path, name: str) -> dict | None:
    by_rate = rates(folder, name)
    return next(iter(by_rate.values()), None) if by_rate else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def field(run: dict | None, *keys: str) -> float | None:
    for key in keys:
        if run is None:
            return None
        run = run.get(key)
    return run


def tcp_drops(folder: Path, name: str) -> dict[str, int] | None:
    """The kernel's TCP counters over run `name` (gpu_scaleout.sh's tcp_before/tcp_after files): connections
    dropped from a full accept queue (ListenOverflows), and SYNs sent again."""
    before, after = (folder / f"{name}.tcp_before.txt", folder / f"{name}.tcp_after.txt")
    if not (before.exists() and after.exists()):
        return None
    counts = [dict((key, int(value)) for key, value in (line.split() for line in path.read_text().splitlines()))
              for path in (before, after)]
    return {key: counts[1][key] - counts[0][key] for key in counts[1]}


def bursts(burst: dict | None) -> list[dict]:
    """bench/burst_arrival.py's bursts: per path and round, the slow connections and the arrivals."""
    if not burst:
        return []
    return [{"path": r["path"], "round": r["round"], "connections": r["connections"],
             "slow_connects": r["slow_connects"], "listen_overflows": r["listen_overflows"],
             "arrival_p50_ms": r["arrival_ms"]["p50"], "arrival_p90_ms": r["arrival_ms"]["p90"],
             "arrival_spread_ms": r["arrival_spread_ms"], "first_token_p50_ms": r["first_token_ms"]["p50"]}
            for r in burst["runs"]]


def summarize(folder: Path, gpus: int) -> dict:
    run = {name.stem: first_rate(folder, name.stem) for name in folder.glob("*.json")
           if name.stem not in ("summary", "burst_arrival") and not name.stem.startswith("router_overhead")}
    one, many = run.get("dp1_small"), run.get(f"dp{gpus}_small")
    own, rr = run.get(f"dp{gpus}_small_smg_own"), run.get(f"dp{gpus}_small_rr")
    direct = run.get(f"dp{gpus}_small_direct")
    summary = {
        "date": datetime.date.today().isoformat(),
        "device": (folder / "gpus.txt").read_text().strip().replace("\n", "; ") if (folder / "gpus.txt").exists()
        else "", "command": "bench/gpu_scaleout.sh", "gpus": gpus,
        "scale_out": {"one_replica_direct_tok_s": field(one, "output_tok_per_s"),
                      f"{gpus}_replicas_smg_tok_s": field(many, "output_tok_per_s"),
                      "ratio_to_n_x_one": ratio(field(many, "output_tok_per_s"),
                                                gpus * (field(one, "output_tok_per_s") or 0)),
                      "target": 0.95,
                      # the same replicas with no router: each client process drives one replica's gateway
                      f"{gpus}_replicas_direct_tok_s": field(direct, "output_tok_per_s"),
                      "direct_ratio_to_n_x_one": ratio(field(direct, "output_tok_per_s"),
                                                       gpus * (field(one, "output_tok_per_s") or 0)),
                      # the same replicas through SMG's own launcher, its port's accept queue at 128
                      f"{gpus}_replicas_smg_own_launcher_tok_s": field(own, "output_tok_per_s"),
                      "own_launcher_ratio_to_n_x_one": ratio(field(own, "output_tok_per_s"),
                                                             gpus * (field(one, "output_tok_per_s") or 0)),
                      # ... and through up's launcher with round robin
                      f"{gpus}_replicas_smg_round_robin_tok_s": field(rr, "output_tok_per_s"),
                      "round_robin_ratio_to_n_x_one": ratio(field(rr, "output_tok_per_s"),
                                                            gpus * (field(one, "output_tok_per_s") or 0)),
                      "tcp_drops": {name: drops for name in ("dp1_small", f"dp{gpus}_small", f"dp{gpus}_small_smg_own",
                                                             f"dp{gpus}_small_rr")
                                    if (drops := tcp_drops(folder, name)) is not None}},
        "connection_bursts": bursts(report(folder, "burst_arrival")),
        "accept_queue": (folder / "accept_queue.txt").read_text().strip().replace("\n", "; ")
        if (folder / "accept_queue.txt").exists() else None,
        "router_added_ttft_ms": router_added_ttft(report(folder, "router_overhead")),
        "smg_own_added_ttft_ms": smg_own(report(folder, "router_overhead_echo"))
        + smg_own(report(folder, "router_overhead_echo_wait")),
        "dp2_vs_tp2": {shape: {"dp2_smg_tok_s": field(run.get(f"dp2_{shape}"), "output_tok_per_s"),
                               "tp2_direct_tok_s": field(run.get(f"tp2_{shape}"), "output_tok_per_s"),
                               "dp2_over_tp2": ratio(field(run.get(f"dp2_{shape}"), "output_tok_per_s"),
                                                     field(run.get(f"tp2_{shape}"), "output_tok_per_s"))}
                       for shape in ("small", "big")},
        "tenants": {policy: _tenants(rates(folder, f"tenants_{policy}"))
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
        load: {"output_tok_s": ratio(field(ca, load, "output_tok_s"), field(rr, load, "output_tok_s")),
               "ttft_p90": ratio(field(ca, load, "ttft_p90_ms"), field(rr, load, "ttft_p90_ms"))}
        for load in ("poisson", "saturated")}
    if summary["dp2_vs_tp2"]["small"]["dp2_smg_tok_s"] is None and gpus == 2:  # the DP2 run is the N-replica one
        summary["dp2_vs_tp2"]["small"]["dp2_smg_tok_s"] = field(many, "output_tok_per_s")
        summary["dp2_vs_tp2"]["small"]["dp2_over_tp2"] = ratio(field(many, "output_tok_per_s"),
                                                               field(run.get("tp2_small"), "output_tok_per_s"))
    return summary


def router_added_ttft(overhead: dict | None) -> dict | None:
    """bench/router_overhead.py's one run against the running replicas: TTFT p50 straight to replica 0,
    to the replicas in turn and through SMG, and the median added time over each."""
    if not overhead or not overhead["runs"]:
        return None
    r = overhead["runs"][0]
    return {"prompt_tokens": r["prompt_tokens"], "requests": overhead["requests"],
            **{f"{path}_p50": r[path]["first_token_ms"]["p50"] for path in ("one", "spread", "router") if path in r},
            **{f"over_{key[11:-3]}": r[key]["first_token"] for key in r if key.startswith("added_over_")}}


def smg_own(overhead: dict | None) -> list[dict]:
    """bench/router_overhead.py against echo backends (answering at once or after a delay): SMG's own
    added TTFT p50 by policy and prompt length."""
    if not overhead:
        return []
    return [{"policy": r["policy"], "prompt_tokens": r["prompt_tokens"], "echo_delay_ms": overhead["echo_delay_ms"],
             "added": r["added_over_one_ms"]["first_token"]} for r in overhead["runs"]]


def _tenants(by_rate: dict[str, dict] | None) -> dict | None:
    """The Poisson run (the finite rate) and the saturated one (inf) of a policy."""
    if by_rate is None:
        return None
    return {"saturated" if rate == "inf" else "poisson": {
        "rate": rate, "output_tok_s": run["output_tok_per_s"], "ttft_p50_ms": field(run, "ttft_ms", "p50"),
        "ttft_p90_ms": field(run, "ttft_ms", "p90"), "completed": run["completed"], "failed": run["failed"],
        "prefix_hit_rate": run.get("prefix_hit_rate"), "requests_per_replica": run.get("requests_per_replica")}
        for rate, run in by_rate.items()}


def markdown(s: dict) -> str:
    def num(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    so, t = s["scale_out"], s["tenants"]
    replicas, own = so[f"{s['gpus']}_replicas_smg_tok_s"], so[f"{s['gpus']}_replicas_smg_own_launcher_tok_s"]
    rr = so[f"{s['gpus']}_replicas_smg_round_robin_tok_s"]
    direct = so[f"{s['gpus']}_replicas_direct_tok_s"]
    lines = [f"# Scale-out, {s['date']}, {s['device']} ({s['gpus']} GPUs), `{s['command']}`", "",
             "| measure | value |", "| --- | --- |",
             f"| one replica direct, output tok/s | {num(so['one_replica_direct_tok_s'], 0)} |",
             f"| {s['gpus']} replicas through SMG, output tok/s | {num(replicas, 0)} |",
             f"| ... over {s['gpus']} x one replica (target >= 0.95) | {num(so['ratio_to_n_x_one'])} |",
             f"| the same replicas with no router (client processes split over their gateways), output tok/s, "
             f"over {s['gpus']} x one | {num(direct, 0)}, {num(so['direct_ratio_to_n_x_one'])} |",
             f"| the same through SMG's own launcher (accept queue 128), output tok/s, over {s['gpus']} x one | "
             f"{num(own, 0)}, {num(so['own_launcher_ratio_to_n_x_one'])} |",
             f"| the same through up's launcher with round robin, output tok/s, over {s['gpus']} x one | "
             f"{num(rr, 0)}, {num(so['round_robin_ratio_to_n_x_one'])} |"]
    if s["accept_queue"]:
        lines.append(f"| the router's accept queue (its line), the host's cap | {s['accept_queue']} |")
    for name, drops in so["tcp_drops"].items():
        lines.append(f"| {name}: connections dropped from a full accept queue, SYNs sent again | "
                     f"{drops.get('ListenOverflows')}, {drops.get('TCPSynRetrans')} |")
    for b in s["connection_bursts"]:
        lines.append(f"| burst of {b['connections']} connections, {b['path']} (round {b['round']}): slow connects, "
                     f"accept-queue drops, arrival p50 / p90 / spread ms, first token p50 ms | {b['slow_connects']}, "
                     f"{b['listen_overflows']}, {num(b['arrival_p50_ms'], 0)} / {num(b['arrival_p90_ms'], 0)} / "
                     f"{num(b['arrival_spread_ms'], 0)}, {num(b['first_token_p50_ms'], 0)} |")
    if s["router_added_ttft_ms"]:
        a = s["router_added_ttft_ms"]
        lines.append(f"| router's added TTFT p50, one request at a time ({a['prompt_tokens']} tokens), over replica 0 "
                     f"/ over the replicas in turn, ms (target <= 2) | {num(a.get('over_one'))} / "
                     f"{num(a.get('over_spread'))} (TTFT {num(a.get('one_p50'))} / {num(a.get('spread_p50'))} direct, "
                     f"{num(a.get('router_p50'))} via SMG) |")
    for row in s["smg_own_added_ttft_ms"]:
        lines.append(f"| SMG's own added TTFT p50 ({row['policy']}, {row['prompt_tokens']}-token prompts, echo "
                     f"backends answering after {row['echo_delay_ms']:g} ms), ms | {num(row['added'])} |")
    for shape, row in s["dp2_vs_tp2"].items():
        name = "0.6B" if shape == "small" else "8B"
        lines.append(f"| {name}: DP2 via SMG / TP2 direct, output tok/s | {num(row['dp2_smg_tok_s'], 0)} / "
                     f"{num(row['tp2_direct_tok_s'], 0)} ({num(row['dp2_over_tp2'])}x) |")
    for load in ("poisson", "saturated"):
        for policy in ("round_robin", "cache_aware"):
            if t[policy] and load in t[policy]:
                row = t[policy][load]
                lines.append(f"| tenants, {load} ({row['rate']} req/s), {policy}: output tok/s, TTFT p50 / p90 ms, "
                             f"prefix hit rate, requests per replica | {num(row['output_tok_s'], 0)}, "
                             f"{num(row['ttft_p50_ms'], 0)} / {num(row['ttft_p90_ms'], 0)}, "
                             f"{num(row['prefix_hit_rate'])}, "
                             f"{' / '.join(map(str, row['requests_per_replica'] or []))} |")
        ratios = t["cache_aware_over_round_robin"][load]
        # the targets are the Poisson run's: its rate saturates round robin and not cache-aware
        targets = (" (target >= 1.6)", " (target <= 0.1)") if load == "poisson" else ("", "")
        lines.append(f"| tenants, {load}, cache-aware over round robin: output tok/s{targets[0]}, "
                     f"TTFT p90{targets[1]} | {num(ratios['output_tok_s'])}, {num(ratios['ttft_p90'])} |")
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
