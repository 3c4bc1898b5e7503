"""nanoserve.race.unless: the work's result, or Interrupted with the work cancelled."""
import asyncio

import pytest

from nanoserve.race import Interrupted, unless


def test_the_work_finishing_first_gives_its_result():
    async def main() -> int:
        return await unless(asyncio.sleep(0, result=7), asyncio.Event().wait())
    assert asyncio.run(main()) == 7


def test_the_interruption_first_cancels_the_work():
    async def main() -> None:
        work = asyncio.ensure_future(asyncio.sleep(10))
        with pytest.raises(Interrupted):
            await unless(work, asyncio.sleep(0))
        await asyncio.sleep(0)
        assert work.cancelled()
    asyncio.run(main())
