"""The Triton interpreter's process for the kernel tests.

Triton decides between interpreter and compiler when a kernel is decorated, i.e. when a
nanoserve_kernels.triton_* module is first imported, so TRITON_INTERPRET=1 must be set before that
import; any earlier test in the same pytest process may already have imported them compiled. The
interpreted cases therefore run in a child process whose environment sets the variable from the start:
one child per pytest process, kept for the session (a Python start with torch and Triton costs about as
much CPU as a small case), which runs each case as `run_interpreted_cases(case)` of the test module that
asks for it. A case that fails says why in the test's assertion; one that takes longer than its timeout
costs the child (the next case starts another).

    python -m tests.worker.interpreter    # the child: one JSON request a line on stdin, one answer on stdout
"""
import contextlib
import importlib
import io
import json
import os
import select
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Interpreter:
    """The child process, started on the first case."""

    def __init__(self) -> None:
        self._child: subprocess.Popen | None = None

    def run(self, test_file: str, case: str, timeout: float = 600) -> None:
        """Runs `case` of the test module at `test_file` in the child; an AssertionError with the case's
        output and traceback when it fails."""
        module = ".".join(Path(test_file).resolve().relative_to(REPO).with_suffix("").parts)
        child = self._started()
        child.stdin.write(json.dumps({"module": module, "case": case}) + "\n")
        child.stdin.flush()
        if not select.select([child.stdout], [], [], timeout)[0]:
            self.close()
            raise AssertionError(f"{module} {case}: no answer from the interpreter after {timeout:.0f}s")
        line = child.stdout.readline()
        if not line:
            self.close()
            raise AssertionError(f"{module} {case}: the interpreter's process exited with code {child.returncode}")
        answer = json.loads(line)
        assert answer["ok"], answer["output"]

    def _started(self) -> subprocess.Popen:
        if self._child is None:
            pythonpath = os.pathsep.join(filter(None, [str(REPO), str(REPO / "proto"), os.environ.get("PYTHONPATH")]))
            self._child = subprocess.Popen(
                [sys.executable, "-m", "tests.worker.interpreter"], cwd=REPO, text=True, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath})
        return self._child

    def close(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None


def fix_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int(array of shape (1,)),
    which numpy >= 2.4 refuses, so `range(start, end)` over loaded values fails
    (triton-lang/triton#9171). Apply the upstream fix: squeeze first."""
    from triton.runtime import interpreter
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def patch_the_language_once_a_launch() -> None:
    """Triton 3.6's interpreter patches triton.language again at every call of a @triton.jit helper
    (inspect.getmembers over the language's modules), though the kernel's launch patched it already
    and keeps it patched until the launch ends: 40% of the gemv case's time. A helper's call now finds
    the modules it sees patched and patches nothing; the launch's restore ends the patching."""
    import triton.language as tl
    from triton.runtime import interpreter
    patch_lang, restore = interpreter._patch_lang, interpreter._LangPatchScope.restore
    patched: set[int] = set()  # ids of the language modules the running launch patched

    def patch_lang_once(fn) -> interpreter._LangPatchScope:
        langs = {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}
        if langs <= patched:
            return interpreter._LangPatchScope()  # nothing patched, nothing to restore
        patched.update(langs)
        return patch_lang(fn)

    def restore_and_forget(scope: interpreter._LangPatchScope) -> None:
        restore(scope)
        patched.clear()

    interpreter._patch_lang = patch_lang_once
    interpreter._LangPatchScope.restore = restore_and_forget


def stand_in_for_libdevice() -> None:
    """The interpreter has no libdevice (its functions return None): tl.math's stand in for the rsqrt
    of the fused gemv's prologue and the exp of its epilogue, looked up per call (the interpreter
    patches them to numpy only while a kernel runs)."""
    import triton.language as tl
    from triton.language.extra import libdevice
    libdevice.rsqrt, libdevice.exp = (lambda x: tl.math.rsqrt(x)), (lambda x: tl.math.exp(x))


def serve() -> None:
    """The child's loop: each request's case, its output (and traceback) captured for the answer."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    fix_interpreter_for_numpy_2_4()
    patch_the_language_once_a_launch()
    stand_in_for_libdevice()
    answers = os.fdopen(os.dup(1), "w")  # stdout carries the answers only: what else is written to it goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        request, output, ok = json.loads(line), io.StringIO(), True
        try:
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                importlib.import_module(request["module"]).run_interpreted_cases(request["case"])
        except Exception:  # noqa: BLE001 (the test reports it)
            ok = False
            output.write(traceback.format_exc())
        answers.write(json.dumps({"ok": ok, "output": output.getvalue()}) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve()
