"""The worker's step loop (WorkerService.Step) around a real CPU runner: replies come in request
order, a bad step is refused alone with its reason while the steps around it run, and every
launched step reports the host time it took."""
import threading

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
