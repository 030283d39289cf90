"""The grant listener stops when closed, whatever its client does with the cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from keyserial.redis._grants import GrantListener

pytestmark = pytest.mark.asyncio


class PubSubTurningCancellationIntoAnError:
    """A pub/sub whose read, when cancelled, fails as redis-py can when a connection drops
    during the cancellation: with a ``ConnectionError`` instead of ``CancelledError``."""

    def __init__(self, subscriptions: list[str]) -> None:
        self.subscriptions = subscriptions

    async def subscribe(self, channel: str) -> None:
        self.subscriptions.append(channel)

    async def listen(self) -> AsyncIterator[dict[str, Any]]:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ConnectionError("connection closed while reading") from None
        yield {}  # never reached: makes this an async generator

    async def aclose(self) -> None:
        pass


class Client:
    def __init__(self) -> None:
        self.subscriptions: list[str] = []

    def pubsub(self) -> PubSubTurningCancellationIntoAnError:
        return PubSubTurningCancellationIntoAnError(self.subscriptions)


async def test_close_stops_a_listener_whose_cancellation_became_another_error() -> None:
    client = Client()
    listener = GrantListener(client)  # type: ignore[arg-type]
    await listener.ready
    await listener.close(within=5.0)
    assert listener.task.done()
    # It subscribed once, and did not subscribe again after its cancellation.
    assert client.subscriptions == [listener.channel]
