"""The engine's Waker: request streams are woken a slice at a time, and other work queued on the
event loop (the engine's own callbacks) runs between slices instead of after all of them."""
import asyncio
import time

from scheduler_svc.engine import Waker
from scheduler_svc.request_stream import RequestStream
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


def test_a_backed_up_loop_makes_the_next_slice_wait_and_the_tokens_gather():
    """A slice whose turn overran max_lag (a handler that blocked the loop) is followed by a pause
    as long, before the next slice is woken: the engine's callbacks get the loop first."""
    async def scenario() -> tuple[float, float]:
        waker = Waker(slice_size=1, max_lag=0.005)
        streams = [RequestStream(Sequence(i, [1], SamplingOptions())) for i in range(2)]
        woken_at: list[float] = []
        loop = asyncio.get_running_loop()

        async def handler(stream: RequestStream, blocks_for: float) -> None:
            await stream.wakeup.wait()
            woken_at.append(loop.time())
            time.sleep(blocks_for)  # a turn that holds the loop, as 16 handlers' writes do under load

        handlers = [asyncio.create_task(handler(streams[0], 0.05)), asyncio.create_task(handler(streams[1], 0))]
        await asyncio.sleep(0)
        task = asyncio.create_task(waker.run())
        waker.wake_soon(streams)
        await asyncio.gather(*handlers)
        task.cancel()
        return woken_at[0], woken_at[1]

    first, second = asyncio.run(scenario())
    assert second - first >= 2 * 0.05 * 0.9  # the blocked turn, then a pause as long


def test_a_quick_turn_wakes_the_next_slice_without_a_pause():
    async def scenario() -> float:
        waker = Waker(slice_size=1, max_lag=0.5)
        streams = [RequestStream(Sequence(i, [1], SamplingOptions())) for i in range(20)]
        loop = asyncio.get_running_loop()
        handlers = [asyncio.create_task(s.wakeup.wait()) for s in streams]
        await asyncio.sleep(0)
        task = asyncio.create_task(waker.run())
        started = loop.time()
        waker.wake_soon(streams)
        await asyncio.gather(*handlers)
        task.cancel()
        return loop.time() - started

    assert asyncio.run(scenario()) < 0.5  # 20 slices, none followed by a pause
