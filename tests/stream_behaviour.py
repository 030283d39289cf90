"""Behaviour a KeyedStream shows alike on every backend, written once for the tests of each."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from keyserial.streams import KeyedStream, StreamMessage

from .redis_helpers import until


async def consumers_share_partitions_and_take_them_back(
    first: KeyedStream,
    second: KeyedStream,
    start: Callable[[KeyedStream], None],
    stop: Callable[[KeyedStream], Awaitable[None]],
) -> None:
    """Two consumers of one stream of 8 partitions own 4 each and both handle messages; once
    ``second`` stops, ``first`` owns all 8 again."""
    handled: dict[KeyedStream, list[str]] = {first: [], second: []}
    for stream in (first, second):

        @stream.consumer(drain_timeout=5)
        async def handle(message: StreamMessage, stream: KeyedStream = stream) -> None:
            handled[stream].append(message.id)

    start(first)
    await until(lambda: len(first.stats().partitions) == 8, "first owns all", seconds=10)
    start(second)
    await until(
        lambda: len(first.stats().partitions) == len(second.stats().partitions) == 4,
        "four partitions each",
        seconds=10,
    )
    assert set(first.stats().partitions) | set(second.stats().partitions) == set(range(8))
    for n in range(40):
        await first.publish(f"key-{n}", {"n": n})
    await until(lambda: len(handled[first]) + len(handled[second]) == 40, "all handled")
    assert handled[first] and handled[second]
    await stop(second)
    await until(lambda: len(first.stats().partitions) == 8, "first owns all again", seconds=10)
