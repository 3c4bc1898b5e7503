"""A worker serves one scheduler session at a time (worker_svc/sessions.py), answers UNAVAILABLE
while its model loads, and refuses at start a device or backend it cannot run (preflight.py)."""
import grpc
import pytest
import torch

from worker_svc.config import WorkerConfig
from worker_svc.preflight import StartupError, check_startup
from worker_svc.server import WorkerService
from worker_svc.sessions import OPEN_STREAM_SECONDS, SessionRefused, Sessions


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sessions(clock) -> Sessions:
    return Sessions(clock)


def allocate(sessions: Sessions, session: str, ok: bool = True) -> None:
    sessions.begin_allocation(session, f"peer-of-{session}")
    sessions.end_allocation(session, ok)


def test_a_live_session_refuses_another_and_names_itself(sessions):
    allocate(sessions, "aaaaaaaa-first")
    sessions.open_stream("aaaaaaaa-first")
    with pytest.raises(SessionRefused, match="serves scheduler session aaaaaaaa from peer-of-aaaaaaaa-first .*"
                                             "step stream is open"):
        sessions.begin_allocation("bbbbbbbb-second", "peer-of-second")
    with pytest.raises(SessionRefused, match="session bbbbbbbb was refused: this worker is held by .*aaaaaaaa"):
        sessions.open_stream("bbbbbbbb-second")


def test_the_next_session_takes_over_once_the_holders_stream_closed(sessions):
    allocate(sessions, "first")
    sessions.open_stream("first")
    sessions.close_stream("first")
    with pytest.raises(SessionRefused, match="session first has ended"):  # it cannot come back
        sessions.open_stream("first")
    allocate(sessions, "second")
    sessions.open_stream("second")


def test_an_allocation_in_progress_holds_the_worker(sessions, clock):
    sessions.begin_allocation("first", "peer")
    clock.now += 10 * OPEN_STREAM_SECONDS  # graph capture can take long: no deadline while allocating
    with pytest.raises(SessionRefused, match="allocating the KV cache"):
        sessions.begin_allocation("second", "peer")


def test_a_session_that_never_opens_its_stream_lapses(sessions, clock):
    allocate(sessions, "first")
    clock.now += OPEN_STREAM_SECONDS - 1
    with pytest.raises(SessionRefused, match="has not opened its step stream yet"):
        allocate(sessions, "second")
    clock.now += 2
    allocate(sessions, "second")
    sessions.open_stream("second")


def test_a_failed_allocation_holds_nothing(sessions):
    allocate(sessions, "first", ok=False)
    with pytest.raises(SessionRefused, match="no KV cache allocated"):
        sessions.open_stream("first")
    allocate(sessions, "second")


class Aborted(Exception):
    pass


class RecordingContext:
    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted


@pytest.mark.parametrize("call", ["Describe", "AllocateKVCache"])
def test_a_loading_worker_answers_unavailable(call):
    context = RecordingContext()
    with pytest.raises(Aborted):
        getattr(WorkerService(), call)(None, context)
    assert context.code == grpc.StatusCode.UNAVAILABLE and context.details.startswith("loading")


@pytest.mark.parametrize("flags, message", [
    (dict(device="cuda"), "--device cuda, but CUDA is not available"),
    (dict(device="cpu", attention_backend="flash-attn"), "flash-attn runs on CUDA only"),
    (dict(device="cpu", attention_backend="triton"), "triton runs on CUDA (or under TRITON_INTERPRET=1)"),
])
def test_a_device_or_backend_that_cannot_run_is_refused_at_start(flags, message, tiny_model_dir, monkeypatch):
    if flags.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(StartupError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_startup(WorkerConfig(model=str(tiny_model_dir), **flags))


def test_a_checkpoint_without_config_json_is_named(tmp_path):
    with pytest.raises(StartupError, match=f"--model {tmp_path} has no config.json"):
        check_startup(WorkerConfig(model=str(tmp_path), device="cpu"))
    check_startup(WorkerConfig(model="Org/not-a-local-dir", device="cpu"))  # left to the loader
