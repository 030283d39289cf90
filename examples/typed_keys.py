"""Keys that type checkers in strict mode can follow (a bare lambda's parameters are unknown)."""

from keyserial import serialized


def seg_id_of(seg_id: str, *args: object, **kwargs: object) -> str:
    return seg_id


@serialized(key="seg_id")  # a parameter name: nothing to type
async def save(seg_id: str, text: str) -> None: ...


class TranscriptService:
    @serialized(key=seg_id_of)  # a typed function, as a method receives it: without self
    async def finalize(self, seg_id: str, text: str) -> None: ...

    # The design's lambda form; pyright strict reports its unknown parameters.
    @serialized(key=lambda seg_id, *args, **kwargs: seg_id)  # pyright: ignore[reportUnknownLambdaType, reportUnknownArgumentType]
    async def revise(self, seg_id: str, text: str) -> None: ...
