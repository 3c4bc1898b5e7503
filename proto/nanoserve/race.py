"""Awaiting a piece of work unless something else happens first (a client leaves, a stop is asked
for), shared by the scheduler and the gateway."""
import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


class Interrupted(Exception):
    """The other event came first, and the work was cancelled."""


async def unless(work: Awaitable[T], interruption: Awaitable[object]) -> T:
    """`work`'s result, or Interrupted (the work cancelled) when `interruption` completes first."""
    task = asyncio.ensure_future(work)
    other = asyncio.ensure_future(interruption)
    try:
        await asyncio.wait((task, other), return_when=asyncio.FIRST_COMPLETED)
    finally:
        other.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise Interrupted()
    return task.result()
