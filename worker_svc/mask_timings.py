"""Where the grammar masks' time goes on the sampling rank, per masked step: the matchers' advance
after a step (on the step's reply thread, or the launcher's where the reply was late): its wait for the
step's tokens to come home, the matchers consuming them and filling their next masks; new sequences'
first masks, their compile included (the mask thread); and what the launcher thread spent waiting for
that work, then handing the masks to the draw (the mask kernel's launch, where processors or logprobs
follow; otherwise the sampler's race reads the masks). The fill's part includes queuing the filled rows'
copy to the device. A step whose forward outlasts that work shows no launcher wait.

The figures add up over a run of consecutive masked steps and are logged as one line when the
run ends (the first sampled step with no constrained row), so a benchmark can read each phase's
split from the worker's log (bench/grammar.py does)."""
import logging
import threading

# In the order of the log line: the advance's parts, the first masks', then the launcher thread's.
PARTS = ("tokens_wait", "consume", "fill", "first", "launcher_wait", "queue")


class MaskTimings:
    def __init__(self):
        self._lock = threading.Lock()  # the reply, mask and launcher threads all add
        self.steps = self.rows = 0
        self.seconds = dict.fromkeys(PARTS, 0.0)

    def add(self, **seconds: float) -> None:
        with self._lock:
            for part, value in seconds.items():
                self.seconds[part] += value

    def masked_step(self, rows: int, **seconds: float) -> None:
        """The launcher thread's part of one masked step of `rows` rows."""
        self.add(**seconds)
        self.steps += 1
        self.rows += rows

    def log_run(self, log: logging.Logger) -> None:
        """Logs the run of masked steps that just ended, if any, and starts a new one."""
        if not self.steps:
            return
        with self._lock:
            per_step = " ".join(f"{part}={1e3 * value / self.steps:.3f}" for part, value in self.seconds.items())
            steps, rows = self.steps, self.rows
            self.steps = self.rows = 0
            self.seconds = dict.fromkeys(PARTS, 0.0)
        log.info("grammar masks over %d steps (%d rows), ms a step: %s", steps, rows, per_step)
