"""The engine's Waker: request streams are woken a slice at a time, and other work queued on the
event loop (the engine's own callbacks) runs between slices instead of after all of them."""
import asyncio

from scheduler_svc.engine import RequestStream, Waker
from scheduler_svc.sequence import SamplingOptions, Sequence


def test_streams_are_woken_a_slice_at_a_time_with_other_work_between():
    async def scenario() -> list[str]:
        waker = Waker(slice_size=2)
        streams = [RequestStream(Sequence(i, [1], SamplingOptions())) for i in range(5)]
        events: list[str] = []

        async def handler(stream: RequestStream) -> None:
            await stream.wakeup.wait()
            events.append(f"stream {stream.seq.seq_id}")

        handlers = [asyncio.create_task(handler(s)) for s in streams]
        await asyncio.sleep(0)  # every handler waits
        task = asyncio.create_task(waker.run())
        waker.wake_soon(streams)
        waker.wake_soon(streams[:1])  # added twice before its turn: woken once
        await asyncio.sleep(0)  # the waker wakes the first slice
        asyncio.get_running_loop().call_soon(events.append, "engine")  # e.g. a worker's reply arriving
        await asyncio.gather(*handlers)
        task.cancel()
        return events

    events = asyncio.run(scenario())
    assert events[:2] == ["stream 0", "stream 1"]
    assert "engine" in events[2:4]  # after the first slice, before the last streams
    assert sorted(e for e in events if e.startswith("stream")) == [f"stream {i}" for i in range(5)]


def test_reading_one_completion_keeps_the_wakeup_a_sibling_got_meanwhile():
    """n > 1: the completions share a wakeup and the handler awaits its writes between them; a token
    delivered to a completion already read must still wake the handler (it used to hang)."""
    wakeup = asyncio.Event()
    first, second = (RequestStream(Sequence(i, [1], SamplingOptions()), wakeup=wakeup) for i in range(2))
    wakeup.clear()  # the handler's round: clear once, then read every completion
    assert first.take() == []
    first.new_tokens.append(5)  # the engine delivers while the handler writes the first's message
    wakeup.set()
    assert second.take() == []
    assert wakeup.is_set() and first.take() == [5]
