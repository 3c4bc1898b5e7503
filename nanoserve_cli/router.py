"""The router in front of `up --data-parallel-size N`: SMG (the Shepherd Model Gateway, `pip install
'nanoserve[router]'`), run as a child like every other service, never reimplemented here.

SMG takes the OpenAI API on --openai-port and sends each request to one replica's gateway by its
policy (--router-policy; cache_aware by default: a request goes where its prefix was last served,
unless that replica is far busier). It is set up for replicas that come and go: it probes their
/health every second and leaves one out after two failures (a draining replica answers 503 at once),
it polls their load every second (LOAD_POLL_SECONDS says why), it counts a replica as overloaded only
when a full batch waits or its KV pool is full (overload_flags says why), and it retries a request that a
replica refused (503 while draining) or could not take (connection refused) on another one, so a
rolling restart loses no request. Its port takes a burst of new connections at once (smg_router.py).
"""
import importlib.util
import json
import math
import sys
import time
import urllib.request
from argparse import Namespace

HEALTH_CHECK_SECONDS = 1  # a draining replica is left out within about two of these
# SMG routes a request that matches no cached prefix (every request of a burst of unrelated prompts)
# by expected wait: each replica's load as last polled from its /v1/loads plus what SMG sent it since
# that poll, and a replica not polled yet is all but left out. At SMG's default 10 s a burst right after
# start went nearly all to the one replica polled first (580 of 616 on two H200s). Polled every second,
# and with routing held back until every replica has been polled once, the burst splits evenly.
LOAD_POLL_SECONDS = 1


def overload_flags(max_num_seqs: int) -> list[str]:
    """When SMG leaves a replica out of routing. Its defaults (8 waiting requests, 0.8 KV usage) undo
    cache-aware routing exactly where it pays: a replica holding its tenants' long system prompts sits
    near 0.8 usage with nothing waiting, and one that takes a burst queues more than 8 requests for a
    step or two; leaving it out sends those requests where their prefix is not cached, which fills the
    other replica's pool with the same prompts (on two H200s SMG's overload fallback placed 1,874 of
    the 2,358 requests of bench/gpu_scaleout.sh's tenants: hit rate 0.52, no better than round robin). A replica runs
    up to --max-num-seqs sequences at once, so a shorter queue starts within its next batch: overloaded
    means a whole batch waiting, or a full pool. SMG's spill gate still evens out a lasting imbalance."""
    return ["--worker-overload-waiting-requests", str(max_num_seqs), "--worker-overload-token-usage", "1"]


class RouterMissing(Exception):
    """SMG is not installed; the message says how to install it."""


def router_command(args: Namespace, gateway_urls: list[str], metrics_port: int) -> list[str]:
    """SMG's command line: the replicas' gateways behind one OpenAI port."""
    if importlib.util.find_spec("smg") is None:
        raise RouterMissing("--data-parallel-size > 1 puts the SMG router in front of the replicas, and it is not "
                            "installed: pip install 'nanoserve[router]'")
    # SMG's own launcher, its accept queue deepened (smg_router.py says why); the flags are SMG's alone
    return [sys.executable, "-m", "nanoserve_cli.smg_router", "--host", args.host, "--port", str(args.openai_port),
            "--worker-urls", *gateway_urls, "--policy", args.router_policy,
            "--prometheus-host", args.host, "--prometheus-port", str(metrics_port),
            "--health-check-interval-secs", str(HEALTH_CHECK_SECONDS), "--health-failure-threshold", "2",
            "--worker-startup-check-interval", "1", "--load-monitor-interval", str(LOAD_POLL_SECONDS),
            *overload_flags(args.max_num_seqs),
            # it is stopped first and lets the requests through it finish, as long as a replica would
            "--shutdown-grace-period-secs", str(math.ceil(args.shutdown_timeout)),
            "--log-level", "warn", "--log-json"]  # its text lines carry colour codes, whatever the terminal


def wait_routing(url: str, replicas: int, alive, timeout: float) -> None:
    """Blocks until SMG lists every replica as healthy (GET /workers) and holds a load record of each
    (GET /get_loads; see LOAD_POLL_SECONDS); RuntimeError if a process exits (`alive()` false) or the
    time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the router exited before it routed to every replica")
        try:
            healthy = {worker["url"] for worker in _get(url + "/workers")["workers"] if worker.get("is_healthy")}
            polled = {load["worker"] for load in _get(url + "/get_loads")["loads"]}
            if len(healthy & polled) >= replicas:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the router at {url} did not find all {replicas} replicas healthy and their loads polled "
                       f"within {timeout:.0f}s")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=2) as reply:
        return json.load(reply)
