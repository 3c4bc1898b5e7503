"""Where each worker restart of a bench/chaos.py run spent its time, read from `nanoserve up`'s log
(docs/recovery-time.md): from the kill to the scheduler seeing it ("worker group failed"), to the new
rank's clock starting (its process created, or its standby reading the word to go once its imports
are done: the launcher's detection and back-off), the rank's start-up phases (its "ready in" line),
to the scheduler's "worker group back", and on to the next token any client received after it. The
parts add up to the recovery: the kill to that token (unlike chaos.py's own measure, never a token
of a step that finished before the kill and arrived late)."""
import bisect
import math
import re
from datetime import datetime
from pathlib import Path

from worker_svc.startup_phases import parse_phase_line

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def timed_lines(logs: list[Path]) -> list[tuple[float, str]]:
    """The log lines that carry a time (the services' own), as (wall-clock seconds, line), in time order."""
    found = []
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if stamp := LOG_TIME.match(line):
                found.append((datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), line))
    return sorted(found)


def restart_splits(logs: list[Path], kills: list[float], tokens: list[float]) -> list[dict]:
    """For each kill, the parts of the restart in seconds (a part the log does not show is None);
    `kills` and `tokens` (every token's arrival, sorted) in wall-clock seconds."""
    lines = timed_lines(logs)
    splits = []
    for i, kill in enumerate(kills):
        until = kills[i + 1] if i + 1 < len(kills) else math.inf
        window = [(at, line) for at, line in lines if kill <= at < until]
        detected = next((at for at, line in window if "worker group failed" in line), None)
        back = next((at for at, line in window if "worker group back after" in line), None)
        ready = [(at, parsed) for at, line in window if (parsed := parse_phase_line(line))]
        after = bisect.bisect_right(tokens, back) if back is not None else len(tokens)
        token = tokens[after] if after < len(tokens) else None
        split: dict = {"recovery": None if token is None else token - kill,
                       "detected": None if detected is None else detected - kill,
                       "rank_started": None, "phases": {}, "group_back": None,
                       "first_token": None if token is None else token - back}
        if ready:
            at, (_, total, phases) = max(ready, key=lambda item: item[0])  # the last rank ready
            split |= {"rank_started": at - total - kill, "phases": phases,
                      "group_back": None if back is None else back - at}
        splits.append(split)
    return splits


def describe(split: dict) -> str:
    """One line: `9.1 s to the next token: detected 0.01; rank started +0.12; process start 0.30, ...`."""
    def seconds(value: float | None) -> str:
        return "?" if value is None else f"{value:.2f}"

    phases = ", ".join(f"{name} {value:.2f}" for name, value in split["phases"].items()) or "no start-up line"
    return (f"{seconds(split['recovery'])} s to the next token: detected {seconds(split['detected'])}; rank started "
            f"+{seconds(split['rank_started'])}; {phases}; group back +{seconds(split['group_back'])}; first token "
            f"+{seconds(split['first_token'])}")
