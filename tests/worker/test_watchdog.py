"""The worker's step watchdog: a step unanswered past --step-timeout ends the process (so its
supervisor restarts it); answered steps, however many, never do."""
import subprocess
import sys

from tests.services.processes import ENV

SCRIPT = """
import logging, sys, time
logging.basicConfig(level=logging.INFO)
from worker_svc.watchdog import StepWatchdog
watchdog = StepWatchdog(0.5)
for step_id in range(200):  # answered at once: no hang
    step = object()
    watchdog.launched(step, step_id)
    watchdog.answered(step)
    time.sleep(0.005)
print("answered steps passed", flush=True)
hung = object()
watchdog.launched(hung, 7)
time.sleep(10)
sys.exit(0)
"""


def test_a_step_unanswered_past_the_timeout_ends_the_worker():
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=ENV, capture_output=True, text=True, timeout=120)
    assert "answered steps passed" in done.stdout
    assert done.returncode == 1
    assert "step 7 has not finished within 0.5s (--step-timeout): the device or a peer rank hangs; exiting" \
        in done.stderr
