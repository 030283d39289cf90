import asyncio

from keyserial import serialized

saved: list[str] = []


@serialized(key=lambda seg_id, *args, **kwargs: seg_id)
async def save(seg_id: str, text: str) -> None:
    await asyncio.sleep(0.01)  # a slow write
    saved.append(f"{seg_id}: {text}")


class TranscriptService:
    @serialized(key=lambda seg_id, *args, **kwargs: seg_id)  # keyed by seg_id, not self
    async def finalize(self, seg_id: str, text: str) -> None:
        saved.append(f"{seg_id}: final {text}")


async def main() -> None:
    service = TranscriptService()
    await asyncio.gather(
        save("seg-1", "partial"),
        save("seg-2", "partial"),
        save("seg-1", "revision"),  # waits for seg-1's partial, not for seg-2
        service.finalize(seg_id="seg-1", text="done"),  # and this for the revision
    )
    print("\n".join(saved))


asyncio.run(main())
