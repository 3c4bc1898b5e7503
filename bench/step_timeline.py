"""Where a batch-1 decode step's time goes between the worker's threads, plain and JSON-schema constrained
(issue 40: the 0.6B shape's batch-1 ITL): one `nanoserve up` whose worker has its step path timed
(bench/step_timeline_hooks/sitecustomize.py: the service's code is not changed), batch-1 requests alternated
plain and held to bench/grammar.py's LONG schema, then per kind of step the median of:

  period            the gap between two answers: the ITL the client sees
  launch            the launcher thread applying and queuing the step
  request_wait      the launcher waiting for the step's request, from its previous launch's end
  in_flight         steps launched and not yet answered when this one's launch began
  reply             the reply thread waiting for the step's device work, then building its answer
  answer_to_launch  from an answer to the start of the next launch
  ready             the launcher waiting for the masks before the step's draw (constrained)
  after, advance    the work after the answer, and the grammars' consume and fill within it (constrained)
  launch_<part>     the launch's parts (LAUNCH_PARTS), and launch_other: the launch less its top-level parts

    python3 bench/step_timeline.py --model DIR [--extra "--load-format dummy"] [--rounds 10] [--out FILE]
"""
import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from grammar import LONG, itl_ms, run_one, serving, write_result  # noqa: E402  (bench/, this script's folder)
from nanoserve.v1 import llm_pb2_grpc  # noqa: E402

HOOKS = Path(__file__).resolve().parent / "step_timeline_hooks"
# The launcher's work inside a launch: the runner's host-only part, its forward (the staging wait, the
# graph's replay and the logits inside it), the processors, the draw, the logprobs, the step's marks and copy
# home, the hand-over of its tokens; the grammars' masks for the draw (inside the processors or the draw).
TOP_PARTS = ("apply", "compute", "process", "sample", "finish", "marks", "home")
LAUNCH_PARTS = TOP_PARTS + ("staging", "replay", "logits", "masks")
# A gap between answers longer than this many median periods lies between two requests, not inside one.
BETWEEN_REQUESTS = 5.0


@dataclass(frozen=True)
class Span:
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def holds(self, other: "Span") -> bool:
        return self.start <= other.start and other.end <= self.end


def spans(events: list[list]) -> dict[str, list[Span]]:
    """Each event's spans, by name, in order of start: an entry (name+) paired with the next exit (name-) on
    its thread."""
    opened: dict[tuple[str, str], float] = {}
    found: dict[str, list[Span]] = {}
    for tag, at, thread in sorted(events, key=lambda event: event[1]):
        name, edge = tag[:-1], tag[-1]
        if edge == "+":
            opened[name, thread] = at
        elif (name, thread) in opened:
            found.setdefault(name, []).append(Span(opened.pop((name, thread)), at))
    return {name: sorted(found_spans, key=lambda span: span.start) for name, found_spans in found.items()}


def step_table(events: list[list]) -> dict[str, dict[str, float]]:
    """The medians above, in ms ("in_flight" in steps), for "plain" and "constrained" steps (a step is
    constrained if the launcher waited for masks inside its launch). The k-th launch and the k-th answer are
    one step: the launcher takes the requests in order and the reply thread answers them in order."""
    found = spans(events)
    launches, replies = found.get("launch", []), found.get("reply", [])
    afters, readies, advances = found.get("after", []), found.get("ready", []), found.get("advance", [])
    steps = min(len(launches), len(replies))
    if steps < 3:
        return {}
    typical = statistics.median(replies[i].end - replies[i - 1].end for i in range(1, steps))
    rows: dict[str, list[dict[str, float]]] = {"plain": [], "constrained": []}
    for i in range(1, steps - 1):
        period = replies[i].end - replies[i - 1].end
        if period > BETWEEN_REQUESTS * typical:
            continue
        ready = next((span for span in readies if launches[i].holds(span)), None)
        row = dict(period=period, launch=launches[i].seconds, request_wait=launches[i].start - launches[i - 1].end,
                   in_flight=sum(1 for j in range(i) if replies[j].end > launches[i].start),
                   reply=replies[i].seconds,
                   answer_to_launch=min((launch.start for launch in launches[i + 1:] if launch.start >= replies[i].end),
                                        default=replies[i].end) - replies[i].end)
        parts = {part: sum(span.seconds for span in found.get(part, ()) if launches[i].holds(span))
                 for part in LAUNCH_PARTS}
        row |= {f"launch_{part}": seconds for part, seconds in parts.items()}
        row["launch_other"] = launches[i].seconds - sum(parts[part] for part in TOP_PARTS)
        if ready is not None:
            row["ready"] = ready.seconds
            after = next((span for span in afters if replies[i].end <= span.start < replies[i + 1].start), None)
            if after is not None:
                row["after"] = after.seconds
                row["advance"] = sum(span.seconds for span in advances if after.holds(span))
        rows["constrained" if ready is not None else "plain"].append(row)
    return {kind: {name: statistics.median(row[name] for row in kind_rows if name in row)
                   * (1 if name == "in_flight" else 1e3)
                   for name in kind_rows[0]} | {"steps": len(kind_rows)}
            for kind, kind_rows in rows.items() if kind_rows}


async def alternate(address: str, rounds: int, tokens: int) -> dict[str, list[float]]:
    """Batch-1 ITL (ms) of `rounds` plain and constrained requests, alternated."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = llm_pb2_grpc.LLMStub(channel)
        for constraint in (None, LONG):  # warm-up: the vocabularies are built, the grammar compiled
            await run_one(stub, [1, 2, 3, 4], 16, constraint)
        itl: dict[str, list[float]] = {"plain": [], "constrained": []}
        for _ in range(rounds):
            itl["plain"].append(await itl_ms(stub, None, tokens))
            itl["constrained"].append(await itl_ms(stub, LONG, tokens))
        return itl


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--extra", default="", help="more `nanoserve up` flags, space separated")
    p.add_argument("--rounds", type=int, default=10, help="plain and constrained requests, alternated")
    p.add_argument("--tokens", type=int, default=200, help="tokens a request")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "step_timeline.json"))
    args = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="step-timeline-"))
    hooked = {"PYTHONPATH": str(HOOKS), "NANOSERVE_STEP_TIMELINE": str(folder)}
    with serving(args.model, args.extra, Path(args.out).with_suffix(".server.log"), hooked) as (address, _):
        itl = asyncio.run(alternate(address, args.rounds, args.tokens))
        time.sleep(1.5)  # the worker writes its events out once a second
    events = [json.loads(line) for trace in folder.glob("*.jsonl") for line in trace.read_text().splitlines()]
    result = {"itl_ms": {kind: statistics.median(values) for kind, values in itl.items()}, "itl_runs_ms": itl,
              "steps": step_table(events)}
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
