#!/usr/bin/env bash
# A/B of two trees on one lent GPU (issue 40's batch-1 ITL moves with the host by more than the changes
# measured, so the trees alternate on one machine): bench/step_timeline.py on the 0.6B shape, this tree
# and another, in turn; results under $OUT (default bench/out): tl_<a|b><n>.json and a summary.
#
#   bench/gpu_ab.sh [pairs]    (default 4; ~40-60 s a run)
#
# The other tree is this one with the files in .ab/ laid over it (a git-ignored folder, carried to the GPU
# machine): for a branch B, `for f in $(git diff --name-only HEAD B); do mkdir -p .ab/$(dirname $f);
# git show B:$f > .ab/$f; done` (a file B deletes: leave it out). Each tree runs with itself on the path.
source bench/gpu_env.sh
pairs=${1:-4}
[ -d .ab ] || { echo "no .ab/ folder: nothing to compare"; exit 1; }
other=/tmp/ab-other; rm -rf "$other"; mkdir -p "$other"
tar --exclude=./.ab --exclude=./.whl -cf - . | (cd "$other" && tar xf -) && cp -a .ab/. "$other"/
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
run() {  # tree, name
  (cd "$1" && python3 -m nanoserve_cli.demo_model .cache/qwen3-0.6b-dummy --shape qwen3-0.6b --no-weights >/dev/null &&
    PYTHONPATH=$1:$1/proto:/tmp/site NANOSERVE_CACHE=$1/.cache timeout 120 python3 bench/step_timeline.py \
      --model .cache/qwen3-0.6b-dummy --rounds 10 --extra "--load-format dummy --attention-backend triton" \
      --out "$out/tl_$2.json" > "$out/tl_$2.log" 2>&1)
  echo "$2 done"
}
for i in $(seq "$pairs"); do run "$other" "b$i"; run "$PWD" "a$i"; done
python3 - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("tl_*.json")):
    result = json.loads(path.read_text())
    runs, steps = result["itl_runs_ms"], result["steps"]
    pair = statistics.median(c / p for p, c in zip(runs["plain"], runs["constrained"]))
    print(f"{path.stem}: ITL {result['itl_ms']['plain']:.3f} -> {result['itl_ms']['constrained']:.3f} ms, "
          f"pair median {100 * (pair - 1):+.1f}%, period {steps['plain']['period']:.3f} -> "
          f"{steps['constrained']['period']:.3f} ms, launch {steps['plain']['launch']:.3f} -> "
          f"{steps['constrained']['launch']:.3f} ms")
PY
