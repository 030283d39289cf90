"""Module-level decorated functions and classes, importable so that they can be pickled."""

from __future__ import annotations

from keyserial import KeyedSerialQueue, serialized

QUEUE = KeyedSerialQueue()
calls: list[tuple[str, object]] = []


@serialized(key="seg_id", queue=QUEUE)
async def save(seg_id: str, text: str = "") -> str:
    """Save a segment."""
    calls.append(("save", seg_id))
    return f"{seg_id}:{text}"


class Service:
    def __init__(self, name: str) -> None:
        self.name = name

    @serialized(key=lambda self, seg_id, *a, **k: seg_id, queue=QUEUE)
    async def method(self, seg_id: str) -> str:
        calls.append(("method", (self.name, seg_id)))
        return f"{self.name}:{seg_id}"

    @serialized(key="seg_id", queue=QUEUE)
    @classmethod
    async def class_above(cls, seg_id: str) -> str:
        return f"{cls.__name__}:{seg_id}"

    @classmethod
    @serialized(key="seg_id", queue=QUEUE)
    async def class_below(cls, seg_id: str) -> str:
        return f"{cls.__name__}:{seg_id}"

    @serialized(key="seg_id", queue=QUEUE)
    @staticmethod
    async def static_above(seg_id: str) -> str:
        return f"static:{seg_id}"

    @staticmethod
    @serialized(key="seg_id", queue=QUEUE)
    async def static_below(seg_id: str) -> str:
        return f"static:{seg_id}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Service) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)
