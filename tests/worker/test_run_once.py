"""RunOnce: the work runs once, whichever thread asks first; a thread that must not wait passes over
it while another runs it; an error reaches run()'s caller, not the one that may not fail."""
import threading

import pytest

from worker_svc.run_once import RunOnce


def test_work_runs_once_whoever_asks():
    calls = []
    once = RunOnce(lambda: calls.append(1))
    once.run_unless_busy()
    once.run()
    once.run_unless_busy()
    assert calls == [1]


def test_a_busy_run_is_passed_over_and_waited_for():
    started, release, calls = threading.Event(), threading.Event(), []

    def work():
        started.set()
        release.wait(5)
        calls.append(1)

    once = RunOnce(work)
    runner = threading.Thread(target=once.run)
    runner.start()
    assert started.wait(5)
    once.run_unless_busy()  # returns at once: the other thread is running it
    assert calls == []
    waiter = threading.Thread(target=once.run)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # run() waits for the work
    release.set()
    runner.join(5)
    waiter.join(5)
    assert calls == [1] and not waiter.is_alive()


def test_an_error_is_raised_by_run_not_by_run_unless_busy():
    def work():
        raise ValueError("matcher broke")

    once = RunOnce(work)
    once.run_unless_busy()
    with pytest.raises(ValueError, match="matcher broke"):
        once.run()
