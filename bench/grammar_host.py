"""The host time that JSON-schema constraints add to a worker's steps (issue 40), on the CPU, without a
server: rank 0's ModelRunner on the demo model (the real Qwen3 tokenizer, 151,936 tokens) is driven
the way the scheduler drives it under bench/grammar.py's workload (bench/throughput.py's DESIGN
requests, all arriving at once, chunked into steps of --max-num-batched-tokens, decodes first),
once with every sequence held to bench/grammar.py's LONG schema and once without.

Per step kind (prefill/mixed: a step that computes some prompt; decode), it reports the runner's
launch time (host; on the CPU the forward runs inside it, the same on both sides) and, in the
constrained run, the launcher thread's time in the grammar's hooks: reset (a sequence starts),
draw_masks or mask (the step's masks: whatever of their filling and of the previous step's tokens'
consumption the launcher thread waits for, the copy of the step's rows, and for mask the apply) and
observe (the drawn tokens handed on to the mask thread); `grammar_host_ms` is their sum less the
apply (`_apply`), which on a GPU is a kernel launch but here runs on the CPU. (draw_masks' masks are
applied inside the sampler's race: no launch of their own on a GPU, here the reference's work.)

On a GPU (--device cuda) the forward runs behind the launch, as in serving; each step is still
waited for before the next, so `launch_ms` there is the host's time plus the step's wait.

    python3 bench/grammar_host.py [--model DIR] [--device cuda --load-format dummy] [--decode-steps N]
                                  [--profile FILE]
"""
import argparse
import cProfile
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "proto")]

from grammar import LONG, write_result  # noqa: E402
from nanoserve.step_rows import StepEntry, pack_step  # noqa: E402
from nanoserve.v1 import llm_pb2  # noqa: E402
from scheduler_svc.structured_outputs import GrammarCompiler  # noqa: E402
from throughput import WORKLOADS, workload  # noqa: E402
from worker_svc.config import WorkerConfig  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402

BLOCK = 16


class Timed:
    """Wraps the named methods of `target` so that each step's seconds in them add up by name."""

    def __init__(self, target, names: tuple[str, ...]):
        self.seconds: dict[str, float] = defaultdict(float)
        for name in names:
            setattr(target, name, self._wrap(name, getattr(target, name)))

    def _wrap(self, name: str, method):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
        return timed

    def take(self) -> dict[str, float]:
        taken, self.seconds = dict(self.seconds), defaultdict(float)
        return taken


def drive(runner: ModelRunner, timed: Timed, jobs: list[tuple[list[int], int]], grammar: str, budget: int,
          decode_steps: int) -> list[tuple[str, float, dict[str, float]]]:
    """Runs the prefill phase and `decode_steps` more steps, then forgets the sequences; per step
    (kind, launch seconds, seconds in the grammar's hooks)."""
    sampling = llm_pb2.SamplingParams(temperature=0.6, seed=0, ignore_eos=True)
    computed = [0] * len(jobs)  # tokens in the KV cache
    generated = [0] * len(jobs)
    blocks: list[list[int]] = [[] for _ in jobs]
    next_block, next_job, steps, decodes_left = 0, 0, [], decode_steps

    def grow(seq_id: int, num_tokens: int) -> list[int]:
        """The blocks `seq_id` newly needs to hold `num_tokens` more."""
        nonlocal next_block
        needed = math.ceil((computed[seq_id] + num_tokens) / BLOCK) - len(blocks[seq_id])
        new = list(range(next_block, next_block + max(0, needed)))
        next_block += len(new)
        blocks[seq_id] += new
        return new

    while decodes_left > 0:
        entries, room = [], budget
        for seq_id in range(next_job):  # the running sequences decode first
            if generated[seq_id]:
                entries.append(StepEntry(seq_id, [], computed[seq_id], True, generated[seq_id],
                                         new_block_ids=grow(seq_id, 1)))
                computed[seq_id] += 1
                generated[seq_id] += 1
                room -= 1
        prefill = False
        while room > 0 and next_job <= len(jobs):
            seq_id = next_job - 1 if next_job and not generated[next_job - 1] else next_job
            if seq_id == len(jobs):
                break
            next_job = max(next_job, seq_id + 1)
            prompt = jobs[seq_id][0]
            chunk = prompt[computed[seq_id]:computed[seq_id] + room]
            reset = not computed[seq_id]
            new = grow(seq_id, len(chunk))
            done = computed[seq_id] + len(chunk) == len(prompt)
            entries.append(StepEntry(seq_id, chunk, computed[seq_id], done, 0, reset, sampling if reset else None,
                                     new, grammar=grammar if reset else ""))
            computed[seq_id] += len(chunk)
            generated[seq_id] += done
            room -= len(chunk)
            prefill = True
        started = time.perf_counter()
        runner.launch(pack_step(len(steps), entries)).reply(len(steps))
        seconds = time.perf_counter() - started
        steps.append(("prefill/mixed" if prefill else "decode", seconds, timed.take()))
        decodes_left -= not prefill
    runner.step(pack_step(len(steps), [], forget_seq_ids=range(len(jobs))))
    timed.take()
    return steps


def summary(steps: list[tuple[str, float, dict[str, float]]]) -> dict:
    out = {}
    for kind in ("prefill/mixed", "decode"):
        chosen = [step for step in steps if step[0] == kind]
        hooks = {name for _, _, parts in chosen for name in parts}
        out[kind] = {"steps": len(chosen), "launch_ms_mean": 1e3 * statistics.fmean(s for _, s, _ in chosen),
                     **{f"{name}_ms_mean": 1e3 * statistics.fmean(p.get(name, 0.0) for _, _, p in chosen)
                        for name in sorted(hooks)}}
        if hooks:
            host = [1e3 * (sum(p.values()) - 2 * p.get("_apply", 0.0)) for _, _, p in chosen]  # mask holds _apply
            out[kind]["grammar_host_ms_mean"], out[kind]["grammar_host_ms_max"] = statistics.fmean(host), max(host)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(REPO / ".cache" / "tiny-qwen3"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--load-format", default="auto", help="dummy: random weights (the 0.6B/8B shapes)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--num-seqs", type=int, default=WORKLOADS["design"][0])
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--profile", help="write a cProfile of the constrained run here")
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "grammar_host.json"))
    args = p.parse_args()
    jobs = workload(args.num_seqs, *WORKLOADS["design"][1:])
    # room for every prompt and the tokens of the prefill phase's steps (~20) and the decode steps
    num_blocks = sum(math.ceil((len(prompt) + args.decode_steps + 64) / BLOCK) for prompt, _ in jobs)
    config = WorkerConfig(model=args.model, device=args.device, dtype="float32" if args.device == "cpu" else "auto",
                          load_format=args.load_format, attention_backend=args.attention_backend, block_size=BLOCK, num_kv_blocks=num_blocks,
                          max_num_seqs=max(args.num_seqs, 1), max_num_batched_tokens=args.max_num_batched_tokens)
    runner = ModelRunner(config)
    grammar = GrammarCompiler(runner.grammar_tokenizer).compile("json", json.dumps(LONG))
    runner.allocate_kv_cache(num_blocks)
    timed = Timed(runner.extras.grammar, ("reset", "fill_first_masks", "draw_masks", "mask", "observe", "_apply"))
    result = {}
    for name, text in (("plain", ""), ("json_schema", grammar)):
        drive(runner, timed, jobs[:2], text, args.max_num_batched_tokens, 2)  # warm-up: vocabulary, template
        profile = cProfile.Profile() if args.profile and text else None
        if profile:
            profile.enable()
        result[name] = summary(drive(runner, timed, jobs, text, args.max_num_batched_tokens, args.decode_steps))
        if profile:
            profile.disable()
            profile.dump_stats(args.profile)
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
