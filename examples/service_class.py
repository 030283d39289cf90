"""A transcript service whose methods are serialized per segment.

``TranscriptService`` decorates its methods with ``@serialized``, keyed by the
segment id, on one queue shared by all instances; ``finalize`` calls
``apply_revision`` for the same segment from inside its turn (re-entrancy), and
that nested call runs at once instead of deadlocking.

``PerInstanceService`` gives each instance a queue of its own and takes the
turn with ``async with self.queue.lock(seg_id)``: two instances never order each
other's calls, which suits, say, one service object per tenant.

Run it:  python examples/service_class.py
"""

from __future__ import annotations

import asyncio

from keyserial import KeyedSerialQueue, serialized

SEGMENTS = KeyedSerialQueue(max_pending=100)


class TranscriptService:
    def __init__(self) -> None:
        self.text: dict[str, str] = {}
        self.log: list[str] = []

    @serialized(key="seg_id", queue=SEGMENTS)
    async def save_partial(self, seg_id: str, text: str, latency: float = 0.0) -> None:
        self.log.append(f"{seg_id}: partial {text!r} starts")
        await asyncio.sleep(latency)  # a slow write
        self.text[seg_id] = text

    @serialized(key="seg_id", queue=SEGMENTS)
    async def apply_revision(self, seg_id: str, text: str) -> None:
        self.log.append(f"{seg_id}: revision {text!r}")
        self.text[seg_id] = text

    @serialized(key="seg_id", queue=SEGMENTS, timeout=5.0)
    async def finalize(self, seg_id: str, text: str) -> None:
        # Same task, same key: this nested call runs inside the current turn.
        await self.apply_revision(seg_id, text)
        self.log.append(f"{seg_id}: final {text!r}")
        self.text[seg_id] = f"{text} [final]"


class PerInstanceService:
    def __init__(self, name: str) -> None:
        self.name = name
        self.queue = KeyedSerialQueue()
        self.text: dict[str, str] = {}

    async def save(self, seg_id: str, text: str, latency: float = 0.0) -> None:
        async with self.queue.lock(seg_id):
            await asyncio.sleep(latency)
            self.text[seg_id] = text


async def main() -> tuple[TranscriptService, list[PerInstanceService]]:
    service = TranscriptService()
    # The slow partial is registered first, so the final waits for it and wins.
    await asyncio.gather(
        service.save_partial("seg-1", "helo wor", latency=0.02),
        service.finalize("seg-1", "hello world"),
        service.save_partial("seg-2", "good mor", latency=0.01),
        service.finalize("seg-2", "good morning"),
    )
    tenants = [PerInstanceService("tenant-a"), PerInstanceService("tenant-b")]
    await asyncio.gather(
        *(t.save("seg-1", f"{t.name} partial", latency=0.01) for t in tenants),
        *(t.save("seg-1", f"{t.name} final") for t in tenants),
    )
    return service, tenants


if __name__ == "__main__":
    service, tenants = asyncio.run(main())
    print("shared queue, keyed by segment:")
    for line in service.log:
        print(f"  {line}")
    for seg_id, text in sorted(service.text.items()):
        print(f"  {seg_id} ends as {text!r}")
    print("one queue per instance:")
    for tenant in tenants:
        print(f"  {tenant.name}: seg-1 ends as {tenant.text['seg-1']!r}")
