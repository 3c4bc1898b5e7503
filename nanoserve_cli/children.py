"""The launcher's child processes: started tied to the launcher's life (nanoserve.lifeline), each in
a session of its own (a terminal's Ctrl-C reaches the launcher alone, which stops them in order:
stopping.py), their output relayed line by line to the launcher's stderr, their last error line
kept for its summary."""
import itertools
import os
import re
import subprocess
import sys
import threading

from nanoserve.lifeline import LAUNCHER_PID_ENV

# A log line at level ERROR or CRITICAL (text or JSON format), or the last line of a traceback.
_ERROR_LINE = re.compile(r'\b(ERROR|CRITICAL)\b|"level": "(ERROR|CRITICAL)"|^\w+(Error|Exception|Exit): ')


class Child(subprocess.Popen):
    """A service process whose output passes through the launcher."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, stdin: int | None = None):
        env = {**(os.environ if env is None else env), LAUNCHER_PID_ENV: str(os.getpid())}
        super().__init__(argv, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
        self.last_error = ""
        self.relay = threading.Thread(target=self._relay, name=f"relay-{self.pid}", daemon=True)
        self.relay.start()

    def _relay(self) -> None:
        for raw in self.stdout:
            line = raw.decode(errors="replace")
            sys.stderr.write(line)
            sys.stderr.flush()
            if _ERROR_LINE.search(line):
                self.last_error = line.strip()

    def wait(self, timeout: float | None = None) -> int:
        """Also lets the relay print the child's last lines, so nothing the child said comes after
        what the launcher says about its exit."""
        code = super().wait(timeout)
        self.relay.join(timeout=2)
        return code

    def failure(self) -> str:
        """Why the child ended, for a one-line summary: its exit code and last error line."""
        self.wait()  # the line that explains the exit may still be in the pipe
        return f"exited with code {self.returncode}" + (f": {self.last_error}" if self.last_error else "")


def describe(proc: subprocess.Popen) -> str:
    """A child as a person tells it apart: "worker_svc --rank 1", "nanoserve_cli scheduler"."""
    words = [str(word) for word in proc.args[2:]]
    name = list(itertools.takewhile(lambda word: not word.startswith("-"), words))
    rank = words[words.index("--rank"):][:2] if "--rank" in words else []
    return " ".join(name + rank)


def failure(proc: subprocess.Popen) -> str:
    """How a child ended, e.g. `worker_svc --rank 0 exited with code 1: <its last error line>`."""
    why = proc.failure() if isinstance(proc, Child) else f"exited with code {proc.returncode}"
    return f"{describe(proc)} {why}"
