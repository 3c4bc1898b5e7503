"""The worker's step loop (WorkerService.Step) around a real CPU runner: replies come in request
order, a bad step is refused alone with its reason while the steps around it run, and every
launched step reports the host time it took."""
import threading

from nanoserve.v1 import worker_pb2
from tests.worker.worker_steps import StepWriter, cpu_runner
from worker_svc.server import WorkerService

BLOCK_SIZE = 4
PROMPT = [9707, 11, 847, 829, 374, 220, 16, 17]


class _StreamContext:  # the part of grpc.ServicerContext that Step uses
    def peer(self) -> str:
        return "test"


def test_a_refused_step_is_answered_in_order_between_launched_ones(tiny_model_dir):
    writer = StepWriter(BLOCK_SIZE)
    prefill = writer.request(writer.entry(1, PROMPT, reset=True))
    bad = writer.request(writer.entry(2, [151_936], reset=True))  # outside the vocabulary
    decode = writer.request(writer.entry(1, [], len(PROMPT), num_generated=1))  # feeds in its own token
    answered = threading.Event()

    def requests():
        yield from (prefill, bad, decode)
        answered.wait(timeout=60)  # a stream that ends drops the replies still in flight

    stream = WorkerService(cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=64)).Step(requests(), _StreamContext())
    replies = [next(stream) for _ in range(3)]
    answered.set()
    assert list(stream) == []

    plain_writer = StepWriter(BLOCK_SIZE)
    plain = cpu_runner(tiny_model_dir, BLOCK_SIZE, num_blocks=64)
    first = plain.step(plain_writer.request(plain_writer.entry(1, PROMPT, reset=True)))
    second = plain.step(plain_writer.request(plain_writer.entry(1, first, len(PROMPT), num_generated=1)))
    assert [r.step_id for r in replies] == [prefill.step_id, bad.step_id, decode.step_id]
    assert [list(r.token_ids) for r in replies] == [first, [], second]
    assert not replies[0].error and not replies[2].error
    assert "token id 151936 is outside the vocabulary" in replies[1].error
    assert replies[0].host_seconds > 0 and replies[2].host_seconds > 0 and replies[1].host_seconds == 0


class _DoneStep:
    """A step whose device work is already done; it records when its after-reply work ran."""

    def __init__(self, log: list[str] | None = None):
        self.log = [] if log is None else log

    def reply(self, step_id: int) -> worker_pb2.StepResponse:
        self.log.append(f"reply {step_id}")
        return worker_pb2.StepResponse(step_id=step_id, token_ids=[step_id])

    def after_reply(self) -> None:
        self.log.append("after reply")


class _SlowLaunchRunner:
    """Launches step 2 only once `release` is set, as a long host launch holds the launcher."""

    def __init__(self):
        self.release, self.launching_second, self.launched_second = (threading.Event() for _ in range(3))

    def launch(self, request: worker_pb2.StepRequest) -> _DoneStep:
        if request.step_id == 2:
            self.launching_second.set()
            self.release.wait(timeout=10)
            self.launched_second.set()
        return _DoneStep()


def test_a_finished_step_is_answered_while_the_next_one_is_still_being_launched():
    """The scheduler sends step N+3 when step N's reply comes: a reply held back behind the next
    launch's host time put that time into every step's round trip (batch-1 decode ran at host time
    plus round trip a token, not at the device's pace)."""
    runner, done = _SlowLaunchRunner(), threading.Event()

    def requests():
        yield from (worker_pb2.StepRequest(step_id=1), worker_pb2.StepRequest(step_id=2))
        done.wait(timeout=30)

    stream = WorkerService(runner).Step(requests(), _StreamContext())
    first = next(stream)
    assert first.step_id == 1 and list(first.token_ids) == [1]
    assert runner.launching_second.wait(timeout=30)
    assert not runner.launched_second.is_set()  # answered while step 2's launch was held
    runner.release.set()
    assert next(stream).step_id == 2
    done.set()
    assert list(stream) == []


class _LoggingRunner:
    def __init__(self):
        self.log: list[str] = []

    def launch(self, request: worker_pb2.StepRequest) -> _DoneStep:
        return _DoneStep(self.log)


def test_a_steps_after_reply_work_waits_until_its_reply_is_handed_out():
    """The grammars' advance needs a step's tokens, not its reply: run after the reply is handed to gRPC
    (which asks for the next one once this one is sent), so the scheduler, which sends a step on each
    reply, never waits for it."""
    runner, done = _LoggingRunner(), threading.Event()

    def requests():
        yield from (worker_pb2.StepRequest(step_id=1), worker_pb2.StepRequest(step_id=2))
        done.wait(timeout=30)

    stream = WorkerService(runner).Step(requests(), _StreamContext())
    assert next(stream).step_id == 1
    assert runner.log == ["reply 1"]  # handed out; its after-reply work not yet run
    assert next(stream).step_id == 2
    assert runner.log == ["reply 1", "after reply", "reply 2"]
    done.set()
    assert list(stream) == []
    assert runner.log == ["reply 1", "after reply", "reply 2", "after reply"]
