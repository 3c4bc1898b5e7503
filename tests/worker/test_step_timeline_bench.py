"""bench/step_timeline.py's reading of a worker's step events, on a scripted timeline whose figures are known:
its step table, and that the hooks wrap nothing outside a worker process."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))  # the script imports bench/grammar.py as its neighbour
_spec = importlib.util.spec_from_file_location("bench_step_timeline", REPO / "bench" / "step_timeline.py")
step_timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_timeline)

HOOKS = REPO / "bench" / "step_timeline_hooks"
MS = 1e-3


def scripted(steps: int, constrained_from: int) -> list[list]:
    """Steps 1 ms apart: the launcher takes step i's request at i ms and launches it in 0.4 ms (its host-only
    part 0.05 ms, then the forward 0.2 ms with the graph's replay 0.1 ms inside; waiting 0.05 ms for masks
    from step `constrained_from` on); the reply thread answers it at i + 1.5 ms after 0.3 ms of
    waiting, then runs 0.2 ms of work after the answer, 0.15 ms of it the grammars' advance."""
    events = []
    for i in range(steps):
        start = i * MS
        events += [["launch+", start, "launcher"], ["launch-", start + 0.4 * MS, "launcher"],
                   ["apply+", start, "launcher"], ["apply-", start + 0.05 * MS, "launcher"],
                   ["compute+", start + 0.05 * MS, "launcher"], ["compute-", start + 0.25 * MS, "launcher"],
                   ["replay+", start + 0.1 * MS, "launcher"], ["replay-", start + 0.2 * MS, "launcher"]]
        if i >= constrained_from:
            events += [["ready+", start + 0.3 * MS, "launcher"], ["ready-", start + 0.35 * MS, "launcher"]]
        answer = start + 1.5 * MS
        events += [["reply+", answer - 0.3 * MS, "grpc"], ["reply-", answer, "grpc"],
                   ["after+", answer, "grpc"], ["after-", answer + 0.2 * MS, "grpc"]]
        if i >= constrained_from:
            events += [["advance+", answer + 0.01 * MS, "grpc"], ["advance-", answer + 0.16 * MS, "grpc"]]
    return events


def test_the_step_table_reads_the_scripted_timeline():
    table = step_timeline.step_table(scripted(12, constrained_from=6))
    plain, constrained = table["plain"], table["constrained"]
    assert plain["steps"] == 5 and constrained["steps"] == 5  # the first and the last step have no neighbours
    for kind in (plain, constrained):
        assert abs(kind["period"] - 1.0) < 1e-9 and abs(kind["launch"] - 0.4) < 1e-9
        assert abs(kind["request_wait"] - 0.6) < 1e-9 and abs(kind["reply"] - 0.3) < 1e-9
        assert kind["in_flight"] == 1  # step i - 1 is answered at i + 0.5 ms, after step i's launch began
        assert abs(kind["answer_to_launch"] - 0.5) < 1e-9
        assert abs(kind["launch_apply"] - 0.05) < 1e-9 and abs(kind["launch_compute"] - 0.2) < 1e-9
        assert abs(kind["launch_replay"] - 0.1) < 1e-9 and kind["launch_sample"] == 0
        assert abs(kind["launch_other"] - 0.15) < 1e-9  # the launch less its top-level parts (not the replay)
    assert "ready" not in plain
    assert abs(constrained["ready"] - 0.05) < 1e-9 and abs(constrained["after"] - 0.2) < 1e-9
    assert abs(constrained["advance"] - 0.15) < 1e-9


def test_a_gap_between_requests_is_not_a_step():
    events = scripted(6, constrained_from=6) + [[name, at + 0.5, thread] for name, at, thread in scripted(6, 6)]
    # 10 steps with a step before and after, less the second request's first: its period spans the 0.5 s gap
    assert step_timeline.step_table(events)["plain"]["steps"] == 9


def test_the_hooks_wrap_the_step_path_in_a_worker_only(tmp_path, monkeypatch):
    """A process started as `python -m worker_svc` has its step methods wrapped and writes their events out
    when it ends (here a process with that word on its command line); any other process, none (this one)."""
    probe = ("import worker_svc.launched_step as m; assert hasattr(m.LaunchedStep.after_reply, '__wrapped__'); "
             "m.LaunchedStep.after_reply(type('Step', (), {'on_home': None})())")
    env = {"PYTHONPATH": f"{HOOKS}:{REPO}:{REPO / 'proto'}", "NANOSERVE_STEP_TIMELINE": str(tmp_path),
           "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", probe, "worker_svc"], env=env, check=True)
    (trace,) = tmp_path.glob("*.jsonl")
    assert [event[0] for event in map(json.loads, trace.read_text().splitlines())] == ["after+", "after-"]
    monkeypatch.setenv("NANOSERVE_STEP_TIMELINE", str(tmp_path))
    spec = importlib.util.spec_from_file_location("step_timeline_hooks", HOOKS / "sitecustomize.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)  # in this process: no finder installed
    assert not any(isinstance(finder, hooks._WrapOnLoad) for finder in sys.meta_path)
