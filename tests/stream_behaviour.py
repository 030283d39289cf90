"""Behaviour a KeyedStream shows alike on every backend, written once for the tests of each."""

from __future__ import annotations

import asyncio

from keyserial.streams import KeyedStream, StreamMessage

from .redis_helpers import until


class Running:
    """``run()`` of each stream as a task; stops them all (gracefully) at the end."""

    def __init__(self) -> None:
        self.tasks: dict[KeyedStream, asyncio.Task[None]] = {}

    def start(self, stream: KeyedStream) -> None:
        self.tasks[stream] = asyncio.create_task(stream.run())

    async def stop(self, stream: KeyedStream) -> None:
        stream.stop()
        await self.tasks.pop(stream)

    async def stop_all(self) -> None:
        for stream in list(self.tasks):
            await self.stop(stream)


async def consumers_share_partitions_and_take_them_back(
    first: KeyedStream, second: KeyedStream, running: Running
) -> None:
    """Two consumers of one stream of 8 partitions own 4 each and both handle messages; once
    ``second`` stops, ``first`` owns all 8 again."""
    handled: dict[KeyedStream, list[str]] = {first: [], second: []}
    for stream in (first, second):

        @stream.consumer(drain_timeout=5)
        async def handle(message: StreamMessage, stream: KeyedStream = stream) -> None:
            handled[stream].append(message.id)

    running.start(first)
    await until(lambda: len(first.stats().partitions) == 8, "first owns all", seconds=10)
    running.start(second)
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
    await running.stop(second)
    await until(lambda: len(first.stats().partitions) == 8, "first owns all again", seconds=10)


async def same_key_in_order_different_keys_concurrently(
    stream: KeyedStream, running: Running
) -> None:
    """Key a's three messages run one at a time, in publish order, while key b's message
    runs to its end as a's first is held."""
    log: list[tuple[str, str, int]] = []
    a_may_finish = asyncio.Event()

    @stream.consumer()
    async def handle(message: StreamMessage) -> None:
        n = int(message.fields["n"])
        log.append(("start", str(message.key), n))
        if message.key == "a" and n == 0:
            await a_may_finish.wait()
        log.append(("end", str(message.key), n))

    for n in range(3):
        await stream.publish("a", {"n": n})
    await stream.publish("b", {"n": 0})
    running.start(stream)
    await until(lambda: ("start", "a", 0) in log, "a's first message started")
    await until(lambda: ("end", "b", 0) in log, "b handled while a is held")
    assert [entry for entry in log if entry[1] == "a"] == [("start", "a", 0)]
    a_may_finish.set()
    await until(lambda: ("end", "a", 2) in log, "all of a handled")
    assert [entry for entry in log if entry[1] == "a"] == [
        (edge, "a", n) for n in range(3) for edge in ("start", "end")
    ]
