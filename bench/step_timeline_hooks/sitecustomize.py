"""Loaded by every Python process started with this folder on PYTHONPATH (bench/step_timeline.py puts it
there for one `nanoserve up`). In a worker process, with NANOSERVE_STEP_TIMELINE naming a folder, it wraps
the step path's functions as their modules load and appends (event, perf_counter, thread) to
<folder>/<pid>.jsonl once a second: "launch" (the launcher thread applying and queuing a step),
"reply" (waiting for a step's device work and building its answer), "after" (the work after the answer),
"ready" (the launcher waiting for a masked draw's masks), "advance" (the grammars' consume and fill), and
the launch's parts (LAUNCH_PARTS in bench/step_timeline.py), each as name+ at entry and name- at exit. Nothing is wrapped anywhere else, so the service itself is unchanged."""
import atexit
import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

FOLDER = os.environ.get("NANOSERVE_STEP_TIMELINE")
# module -> [(class, method, event)]
WRAPPED = {
    "worker_svc.server": [("WorkerService", "_launch", "launch"), ("WorkerService", "_reply", "reply")],
    "worker_svc.launched_step": [("LaunchedStep", "after_reply", "after"), ("LaunchedStep", "__init__", "marks")],
    "worker_svc.grammar_masks": [("GrammarMasks", "_rows_ready", "ready"), ("GrammarMasks", "_advance", "advance"),
                                 ("GrammarMasks", "draw_masks", "masks")],
    # the launch's parts (bench/step_timeline.py: LAUNCH_PARTS)
    "worker_svc.runner": [("ModelRunner", "_apply", "apply"), ("ModelRunner", "_compute", "compute")],
    "worker_svc.step_buffers": [("StepBuffers", "next_staging", "staging")],
    "worker_svc.cuda_graphs": [("StepGraphs", "replay", "replay")],
    "worker_svc.sampling_extras": [("SamplingExtras", "process", "process"), ("SamplingExtras", "finish", "finish"),
                                   ("SamplingExtras", "tokens_home", "home")],
    "nanoserve_model.sampler": [("Sampler", "__call__", "sample")],
    "nanoserve_model.decoder": [("DecoderForCausalLM", "compute_logits", "logits")],
}
events: list[tuple[str, float, str]] = []


def _timed(method, event: str):
    @functools.wraps(method)
    def timed(*args, **kwargs):
        events.append((event + "+", time.perf_counter(), threading.current_thread().name))
        try:
            return method(*args, **kwargs)
        finally:
            events.append((event + "-", time.perf_counter(), threading.current_thread().name))
    return timed


def _write_out(path: str) -> None:
    taken = len(events)
    if taken:
        lines = [json.dumps(entry) for entry in events[:taken]]
        del events[:taken]
        with open(path, "a") as out:
            out.write("\n".join(lines) + "\n")


def _write_each_second(path: str) -> None:
    while True:
        time.sleep(1.0)
        _write_out(path)


class _WrapOnLoad(importlib.abc.MetaPathFinder):
    """Finds WRAPPED's modules through the other finders and wraps their methods once they have run."""

    def find_spec(self, name, path, target=None):
        if name not in WRAPPED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            for class_name, method, event in WRAPPED[name]:
                cls = getattr(module, class_name)
                setattr(cls, method, _timed(getattr(cls, method), event))
        spec.loader.exec_module = exec_module
        return spec


if FOLDER and "worker_svc" in getattr(sys, "orig_argv", ()):  # `python -m worker_svc`
    trace = os.path.join(FOLDER, f"{os.getpid()}.jsonl")
    threading.Thread(target=_write_each_second, args=(trace,), daemon=True).start()
    atexit.register(_write_out, trace)
    sys.meta_path.insert(0, _WrapOnLoad())
