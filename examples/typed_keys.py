"""Keys that strict type checkers can follow."""

from keyserial import serialized


def seg_id_of(seg_id: str, *args: object, **kwargs: object) -> str:
    return seg_id


@serialized(key="seg_id")  # a parameter name: nothing to type
async def save(seg_id: str, text: str) -> None: ...


class TranscriptService:
    # A typed function, which on a method receives no self:
    @serialized(key=seg_id_of)
    async def finalize(self, seg_id: str, text: str) -> None: ...
