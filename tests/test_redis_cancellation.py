"""keyserial's own cancellations of a caller (a request past its deadline, a lost lease) never
swallow a cancellation that came from elsewhere in the same loop iteration."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

from keyserial import LeaseLost
from keyserial.redis import RedisKeyedQueue, encode_key

from .redis_helpers import Clients

# Every test runs in the default mode and in fair mode (the redis_mode fixture).
pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.usefixtures("redis_mode"),
    pytest.mark.skipif(
        sys.version_info < (3, 11), reason="Python 3.10 keeps no count of a task's cancellations"
    ),
]


async def test_a_request_past_its_deadline_still_ends_on_a_cancellation_from_elsewhere(
    clients: Clients, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = RedisKeyedQueue(clients(), namespace="cancel", lease=5.0)
    turns = queue._turns
    also_cancel = False

    async def unanswered(*args: Any) -> Any:
        # Redis never answers. When the request's own timer cancels this wait, the wait's
        # callbacks run in the order they were added, so this one cancels the task from
        # elsewhere before the task's wake-up: both cancellations in one loop iteration on any
        # event loop, with no reliance on two timers due at the same time firing together.
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if also_cancel:
            task = asyncio.current_task()
            assert task is not None
            reply.add_done_callback(lambda _: task.cancel())
        return await reply

    monkeypatch.setattr(turns.runner, "call", unanswered)
    loop = asyncio.get_running_loop()

    async def request() -> None:
        await turns.script(turns.acquire_script, "b", deadline=loop.time() + 0.05)

    with pytest.raises(TimeoutError):
        await request()
    also_cancel = True
    with pytest.raises(asyncio.CancelledError):
        await asyncio.ensure_future(request())
    await queue.aclose()


def lose_the_lease(queue: RedisKeyedQueue, key: str, also_cancel: bool) -> None:
    """What the lease keeper does when the lease is lost, and maybe a cancel from elsewhere."""
    task: asyncio.Task[Any] = asyncio.current_task()  # type: ignore[assignment]
    queue._turns.held[(task, encode_key(key))].lost = True
    task.cancel(msg="keyserial: lease lost")
    if also_cancel:
        task.cancel()


@pytest.mark.parametrize("also_cancel", [False, True])
async def test_a_lost_lease_during_a_call_never_swallows_a_cancellation_from_elsewhere(
    clients: Clients, also_cancel: bool
) -> None:
    queue = RedisKeyedQueue(clients(), namespace="cancel", lease=5.0)

    async def work() -> None:
        lose_the_lease(queue, "k", also_cancel)
        await asyncio.sleep(0)

    expected = asyncio.CancelledError if also_cancel else LeaseLost
    call = asyncio.ensure_future(queue.run("k", work))
    with pytest.raises(expected):
        await call
    assert call.cancelled() == also_cancel
    await queue.aclose()


@pytest.mark.parametrize("also_cancel", [False, True])
async def test_a_lost_lease_in_a_lock_block_never_swallows_a_cancellation_from_elsewhere(
    clients: Clients, also_cancel: bool
) -> None:
    queue = RedisKeyedQueue(clients(), namespace="cancel", lease=5.0)

    async def block() -> None:
        async with queue.lock("k"):
            lose_the_lease(queue, "k", also_cancel)
            await asyncio.sleep(0)

    expected = asyncio.CancelledError if also_cancel else LeaseLost
    call = asyncio.ensure_future(block())
    with pytest.raises(expected):
        await call
    assert call.cancelled() == also_cancel
    await queue.aclose()
