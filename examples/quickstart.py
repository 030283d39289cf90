import asyncio

from keyserial import serialized

saved: list[str] = []


@serialized(key=lambda seg_id, *args, **kwargs: seg_id)
async def save(seg_id: str, text: str) -> None:
    await asyncio.sleep(0.01)  # a slow write
    saved.append(f"{seg_id}: {text}")


class TranscriptService:
    # On a method too, the key function gets the caller's arguments:
    # keyed by seg_id, not by self.
    @serialized(key=lambda seg_id, *args, **kwargs: seg_id)
    async def finalize(self, seg_id: str, text: str) -> None:
        saved.append(f"{seg_id}: final {text}")


async def main() -> None:
    service = TranscriptService()
    await asyncio.gather(
        save("seg-1", "partial"),
        save("seg-2", "partial"),
        save("seg-1", "revision"),  # after seg-1's partial only
        service.finalize(seg_id="seg-1", text="done"),  # then this
    )
    print("\n".join(saved))


asyncio.run(main())
