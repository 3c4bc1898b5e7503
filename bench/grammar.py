"""What structured output costs (issue 40), on one `nanoserve up` per call:

- DESIGN throughput (bench/throughput.py's workload: 256 requests, prompts and outputs uniform in
  [100, 1,024], temperature 0.6, ignore_eos) with every request held to a JSON schema (an object with
  one unbounded lowercase-text string; a request whose object is complete ends early, with stop),
  then requests of the same lengths unconstrained, each asking for as many tokens as its constrained
  run gave: both runs compute as many tokens in the same batches, and only the grammar differs. The
  plain run's prompts are fresh ids of the same lengths: the constrained run's own prompts would be in
  the prefix cache by then (each run reports its prefix-cache hit tokens);
- batch-1 inter-token latency, the two alternated;
- first use of a typical schema (12 properties, nested object, enum, array, bounds), each time a new
  one: the scheduler's check (the text to a grammar, checked against the vocabulary), the sampling
  rank's compile and its first mask, measured in this process with the model's tokenizer;
- every constrained output that ended with stop parsed and validated against its schema (jsonschema),
  among them 64 requests held to a small bounded schema, which most complete;
- where the sampling rank's mask time goes in each constrained run (`mask_split`, ms a masked step:
  the advance after a step waiting for its tokens, consuming them and filling the next masks, mostly on
  the step's reply thread, which also queues the rows' copy; first masks; the launcher thread waiting for
  that, then handing the masks on: the mask kernel, where processors or logprobs follow), read from the
  worker's log
  (worker_svc/mask_timings.py), which goes to `<out>.server.log`.

    python3 bench/grammar.py --model DIR [--extra "--load-format dummy"] [--out FILE]
"""
import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import grpc
import jsonschema
import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from nanoserve.client import make_request  # noqa: E402
from nanoserve.grammar_tokenizer import GrammarTokenizer  # noqa: E402
from nanoserve.v1 import llm_pb2, llm_pb2_grpc  # noqa: E402
from nanoserve_cli.launcher import free_port, stop_all, wait_serving  # noqa: E402
from scheduler_svc.structured_outputs import GrammarCompiler  # noqa: E402
from throughput import WORKLOADS, workload  # noqa: E402

LONG = {"type": "object", "properties": {"notes": {"type": "string", "pattern": "^[a-z ,.]*$"}},
        "required": ["notes"], "additionalProperties": False}
SHORT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "role": {"enum": ["admin", "user"]},
                                          "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
         "required": ["name", "age", "role", "tags"], "additionalProperties": False}


# worker_svc/mask_timings.py's line at the end of a run of masked steps.
MASK_RUN = re.compile(r"grammar masks over (\d+) steps \((\d+) rows\), ms a step: (.*)$")


class ServerLog:
    """The server's log file, read on from where the last look stopped."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    async def mask_runs(self, expected: int = 1, timeout: float = 10.0) -> list[dict]:
        """The runs of masked steps logged since the last look, once `expected` of them are (the log
        comes through the launcher's relay, a moment after the reply)."""
        runs: list[dict] = []
        deadline = time.perf_counter() + timeout
        while len(runs) < expected and time.perf_counter() < deadline:
            await asyncio.sleep(0.2)
            with self.path.open() as log:
                log.seek(self.offset)
                text = log.read()
            self.offset += len(text.encode())  # text mode: offsets in bytes
            for match in map(MASK_RUN.search, text.splitlines()):
                if match:
                    parts = {name: float(value) for name, value in (p.split("=") for p in match[3].split())}
                    runs.append({"steps": int(match[1]), "rows": int(match[2]), **parts})
        return runs


async def end_masked_run(stub, log: ServerLog) -> dict:
    """An unconstrained request ends the run of masked steps, which the worker then logs: its split."""
    await run_one(stub, [1, 2, 3, 4], 1, None)
    runs = await log.mask_runs()
    return runs[-1] if runs else {}


def typical_schema(tag: str) -> dict:
    """An order as an API would describe it; `tag` makes each one new to every cache."""
    item = {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                             "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                                             "price": {"type": "number", "minimum": 0}},
            "required": ["sku", "quantity", "price"], "additionalProperties": False}
    properties = {
        f"order_id_{tag}": {"type": "string", "maxLength": 24}, "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 64}, "email": {"type": "string", "format": "email"},
            "vip": {"type": "boolean"}}, "required": ["name", "email"], "additionalProperties": False},
        "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
        "items": {"type": "array", "items": item, "minItems": 1, "maxItems": 20},
        "currency": {"enum": ["EUR", "USD", "GBP"]}, "total": {"type": "number", "minimum": 0},
        "coupon": {"type": ["string", "null"], "maxLength": 16}, "notes": {"type": "string", "maxLength": 500},
        "created": {"type": "string", "format": "date-time"}, "gift": {"type": "boolean"},
        "priority": {"type": "integer", "minimum": 0, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5}}
    return {"type": "object", "properties": properties, "required": list(properties)[:6],
            "additionalProperties": False}


def compile_times(model: Path, vocab_size: int, eos_ids: tuple[int, ...], count: int = 20) -> dict:
    """First use of `count` new typical schemas: check, compile, first mask (ms each, p50 of each)."""
    tokenizer = GrammarTokenizer(model / "tokenizer.json", vocab_size, eos_ids)
    started = time.perf_counter()
    vocabulary = tokenizer.get()
    build_s = time.perf_counter() - started
    compiler, bitmask = GrammarCompiler(tokenizer), np.zeros((1, (vocab_size + 31) // 32), np.int32)
    parts: dict[str, list[float]] = {"check": [], "compile": [], "first_mask": [], "total": []}
    for i in range(count):
        text = json.dumps(typical_schema(f"{i}_{random.randrange(10**9)}"))
        t0 = time.perf_counter()
        grammar = compiler.compile("json", text)
        t1 = time.perf_counter()
        matcher = llguidance.LLMatcher(vocabulary, grammar)
        t2 = time.perf_counter()
        fill_next_token_bitmask(matcher, bitmask)
        t3 = time.perf_counter()
        for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            parts[name].append(1e3 * seconds)
    return {"vocabulary_build_s": build_s, **{f"{name}_p50_ms": statistics.median(v) for name, v in parts.items()},
            "total_max_ms": max(parts["total"])}


async def run_one(stub, prompt: list[int], max_tokens: int, constraint: dict | None, arrivals: list | None = None):
    sampling = {"structured_outputs": llm_pb2.StructuredOutputs(json=json.dumps(constraint))} if constraint else {}
    request = make_request(prompt, max_tokens=max_tokens, temperature=0.6, ignore_eos=True, **sampling)
    count, text, finish = 0, "", ""
    async for msg in stub.Generate(request):
        count += len(msg.token_ids)
        text += msg.text
        if msg.finish_reason:
            finish = llm_pb2.FinishReason.Name(msg.finish_reason)
        if arrivals is not None:
            arrivals.append((time.perf_counter(), len(msg.token_ids)))
    return count, text, finish


def invalid(results: list, schema: dict) -> tuple[int, int]:
    """(outputs that stopped, how many of those fail to parse or validate)."""
    stopped = [text for _, text, finish in results if finish == "FINISH_REASON_STOP"]
    bad = 0
    for text in stopped:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            bad += 1
    return len(stopped), bad


async def throughput(stub, jobs, constraint: dict | None) -> tuple[dict, list[int]]:
    """The run's figures (with rank 0's view of its decode steps: device busy, device idle before
    each, host time building and launching each; of its prefill steps, mixed ones included: busy and
    host), and each request's output length."""
    before = await stub.GetStats(llm_pb2.GetStatsRequest())
    start = time.perf_counter()
    results = await asyncio.gather(*(run_one(stub, p, n, constraint) for p, n in jobs))
    seconds = time.perf_counter() - start
    after = await stub.GetStats(llm_pb2.GetStatsRequest())
    tokens = sum(count for count, _, _ in results)
    stopped, bad = invalid(results, constraint) if constraint else (0, 0)
    def total(name: str) -> float:
        return getattr(after, name) - getattr(before, name)

    steps, prefills = max(1, total("decode_steps")), max(1, total("prefill_steps"))
    per_step = {f"{kind}_{name}_ms": 1e3 * total(f"{kind}_{name}_seconds") / count
                for kind, count, names in (("decode", steps, ("busy", "idle", "host")), ("prefill", prefills, ("busy", "host")))
                for name in names}
    # the device's time in steps (prefill idle is not counted): the rest of `seconds` is outside the worker
    device_s = sum(map(total, ("decode_busy_seconds", "decode_idle_seconds", "prefill_busy_seconds")))
    return ({"output_tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds, "stopped": stopped,
             "invalid_among_stopped": bad, "decode_steps": steps, "prefill_steps": total("prefill_steps"),
             "mixed_steps": total("mixed_steps"), "device_seconds": device_s,
             "prefix_hit_tokens": total("prefix_cache_hit_tokens"), "prompt_tokens": total("prompt_tokens_total"),
             **per_step},
            [count for count, _, _ in results])


async def itl_ms(stub, constraint: dict | None, tokens: int = 256) -> float:
    """Median gap between streamed tokens of one request (prompt 512 random ids)."""
    arrivals: list = []
    await run_one(stub, [random.randint(0, 10000) for _ in range(512)], tokens, constraint, arrivals)
    gaps = [(b - a) / n for (a, _), (b, n) in zip(arrivals, arrivals[1:]) if n]
    return 1e3 * statistics.median(gaps)


async def measure(address: str, repeats: int, shape: tuple[int, int, int], log: ServerLog) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = llm_pb2_grpc.LLMStub(channel)
        for constraint in (None, LONG):  # warm-up: the vocabularies are built, the grammar compiled
            await run_one(stub, [1, 2, 3, 4], 16, constraint)
        await end_masked_run(stub, log)
        jobs = workload(*shape)
        constrained, lengths = await throughput(stub, jobs, LONG)
        constrained["mask_split"] = await end_masked_run(stub, log)
        fresh = random.Random(1)  # same lengths, other ids: none of the constrained run's cached blocks
        plain, _ = await throughput(stub, [([fresh.randint(0, 10000) for _ in prompt], n)
                                           for (prompt, _), n in zip(jobs, lengths)], None)
        out = {"plain": plain, "json_schema": constrained}
        out["throughput_ratio"] = out["json_schema"]["tok_per_s"] / out["plain"]["tok_per_s"]
        results = await asyncio.gather(*(run_one(stub, p, 256, SHORT) for p, _ in jobs[:64]))
        out["short_schema_64"] = dict(zip(("stopped", "invalid_among_stopped"), invalid(results, SHORT)))
        await end_masked_run(stub, log)
        itl, splits = {"plain": [], "json_schema": []}, []
        for _ in range(repeats):
            itl["plain"].append(await itl_ms(stub, None))
            itl["json_schema"].append(await itl_ms(stub, LONG))
            splits.append(await end_masked_run(stub, log))
        out["itl_batch1_ms"] = {name: statistics.median(values) for name, values in itl.items()}
        out["itl_pairs_ms"] = itl  # each repeat's pair, in order: the spread behind the medians
        out["itl_mask_split"] = {part: statistics.median(split.get(part, 0.0) for split in splits)
                                 for part in splits[0]} if splits and splits[0] else {}
        out["itl_ratio"] = out["itl_batch1_ms"]["json_schema"] / out["itl_batch1_ms"]["plain"]
        info = await stub.GetModelInfo(llm_pb2.GetModelInfoRequest())
    out["model_info"] = {"vocab_size": info.vocab_size, "eos_token_ids": list(info.eos_token_ids)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--extra", default="", help="more `nanoserve up` flags, space separated")
    p.add_argument("--repeats", type=int, default=3, help="batch-1 ITL pairs")
    p.add_argument("--workload", type=int, nargs=3, default=WORKLOADS["design"], metavar=("REQUESTS", "INPUT", "OUTPUT"),
                   help="requests, longest prompt, longest output (default: DESIGN's)")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "grammar.json"))
    args = p.parse_args()
    with serving(args.model, args.extra, Path(args.out).with_suffix(".server.log")) as (address, server_log):
        result = asyncio.run(measure(address, args.repeats, tuple(args.workload), ServerLog(server_log)))
    info = result.pop("model_info")
    result["first_use_compile"] = compile_times(Path(args.model), info["vocab_size"], tuple(info["eos_token_ids"]))
    write_result(result, Path(args.out))


@contextlib.contextmanager
def serving(model: str, extra: str, server_log: Path, env: dict[str, str] | None = None
            ) -> Iterator[tuple[str, Path]]:
    """One `nanoserve up` of `model` with `extra` flags, its output in `server_log`, until the block ends:
    (its address, server_log). `env` is added to its environment; a PYTHONPATH there comes first on its path.
    Where the block fails, the log's end is printed."""
    more = dict(env or {})
    path = [more.pop("PYTHONPATH", None), str(REPO), str(REPO / "proto"), os.environ.get("PYTHONPATH")]
    port = free_port()
    cmd = [sys.executable, "-m", "nanoserve_cli", "up", "--model", model, "--port", str(port),
           "--worker-base-port", str(free_port()), "--max-model-len", "4096", *extra.split()]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout stops the running server too (finally)
    server_log.parent.mkdir(parents=True, exist_ok=True)
    with server_log.open("w") as log_file:
        proc = subprocess.Popen(cmd, env={**os.environ, **more, "PYTHONPATH": os.pathsep.join(filter(None, path))},
                                stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_serving(f"127.0.0.1:{port}", [proc], timeout=900)
        yield f"127.0.0.1:{port}", server_log
    except BaseException:
        print(f"the server's log ({server_log}) ends:\n" + "".join(server_log.read_text().splitlines(True)[-30:]),
              file=sys.stderr)
        raise
    finally:
        stop_all([proc])


def write_result(result: dict, out: Path) -> None:
    """Writes a run's figures, with the command that measured them, to `out` and prints them."""
    result["command"] = " ".join(sys.argv)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
