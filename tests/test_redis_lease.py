"""The lease keeper of a Redis turn, on a fake clock: when it renews, and when it interrupts."""

from __future__ import annotations

import asyncio

import pytest

from keyserial.redis._lease import LeaseKeeper, Turn

from .scheduling import settle

pytestmark = [pytest.mark.asyncio, pytest.mark.fake_clock]

LEASE = 3.0


def now_turn() -> Turn:
    """A turn whose acquire was sent just now."""
    return Turn("base", "1@l", 7, asyncio.get_running_loop().time())


async def test_a_lost_lease_interrupts_the_call() -> None:
    async def refused(turn: Turn, until: float) -> bool:
        return False  # Redis no longer has this turn

    call = asyncio.create_task(asyncio.sleep(3600))
    keeper = LeaseKeeper(now_turn(), call, LEASE, refused)
    with pytest.raises(asyncio.CancelledError):
        await call
    assert keeper.turn.lost
    keeper.stop()


async def test_renewals_keep_the_call_running() -> None:
    renewals: list[float] = []
    loop = asyncio.get_running_loop()

    async def renewed(turn: Turn, until: float) -> bool:
        renewals.append(loop.time())
        return True

    call = asyncio.create_task(asyncio.sleep(10 * LEASE))
    keeper = LeaseKeeper(now_turn(), call, LEASE, renewed)
    await call
    keeper.stop()
    assert len(renewals) == 30  # every third of the lease
    assert not keeper.turn.lost


async def test_a_renewal_out_when_the_call_ends_never_interrupts_the_task_later() -> None:
    # The renewal's own deadline fires in the loop iteration in which the call ends and
    # stops the keeper: the renewal reports TimeoutError, not its cancellation. The task
    # has moved on to other work, which must not be cancelled.
    answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    async def unanswered(turn: Turn, until: float) -> bool:
        try:
            return await answer
        except asyncio.CancelledError:
            raise TimeoutError("the renewal's deadline passed") from None

    next_work = asyncio.Event()

    async def call_then_more_work() -> str:
        await asyncio.sleep(LEASE * 1.5)  # the call: a renewal is out, unanswered
        keeper.stop()  # the call ended
        await next_work.wait()  # the task's next work
        return "finished"

    task = asyncio.create_task(call_then_more_work())
    keeper = LeaseKeeper(now_turn(), task, LEASE, unanswered)
    await asyncio.sleep(LEASE * 2)  # past the lease's end: the renewal was not confirmed
    await settle()
    next_work.set()
    assert await task == "finished"


async def test_the_lease_is_measured_from_before_the_acquire_was_sent() -> None:
    # A reply that took a while (or a process paused between request and reply): the
    # lease in Redis started no earlier than the request, so the keeper counts from there.
    loop = asyncio.get_running_loop()
    asked = loop.time()
    await asyncio.sleep(LEASE * 0.9)  # the acquire's reply arrives late

    async def renewed(turn: Turn, until: float) -> bool:
        return True

    call = asyncio.create_task(asyncio.sleep(3600))
    keeper = LeaseKeeper(Turn("base", "1@l", 7, asked), call, LEASE, renewed)
    assert keeper.expires == asked + LEASE
    assert keeper.holds()
    await asyncio.sleep(LEASE * 0.2)  # past asked + lease, had no renewal been confirmed
    # ... but the keeper renewed at once, seeing little of the lease left.
    assert keeper.holds()
    assert keeper.expires >= asked + LEASE * 0.9 + LEASE
    keeper.stop()
    call.cancel()
    assert not keeper.holds()  # a stopped keeper holds nothing


async def test_an_unconfirmed_lease_stops_holding_at_its_local_end() -> None:
    loop = asyncio.get_running_loop()
    never: asyncio.Future[bool] = loop.create_future()

    async def unanswered(turn: Turn, until: float) -> bool:
        return await never

    call = asyncio.create_task(asyncio.sleep(3600))
    keeper = LeaseKeeper(Turn("base", "1@l", 7, loop.time()), call, LEASE, unanswered)
    await asyncio.sleep(LEASE * 0.99)
    assert keeper.holds()
    await asyncio.sleep(LEASE * 0.02)
    assert not keeper.holds()
    keeper.stop()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
