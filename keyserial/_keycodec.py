"""Keys for the distributed backends: serialized with their type, so that distinct keys differ.

The in-process queue takes any hashable key; a key that must mean the same in every
process is serialized instead: ``"1"``, ``1``, ``b"1"`` and ``("1",)`` are four keys.
"""

from __future__ import annotations

from typing import cast

#: Tuples in keys nest at most this deep.
MAX_KEY_DEPTH = 32


def serialize_key(key: object, backend: str, depth: int = 0) -> bytes:
    """``key`` as bytes that say its type and length: distinct keys never serialize alike.

    Raises:
        TypeError: ``key`` is not a str, bytes, int or a tuple of them.
        ValueError: tuples in ``key`` nest deeper than ``MAX_KEY_DEPTH``.
    """
    if isinstance(key, str):
        data = key.encode("utf-8", "surrogatepass")  # any str, lone surrogates included
        return b"s%d:%s" % (len(data), data)
    if isinstance(key, bytes):
        return b"b%d:%s" % (len(key), key)
    if isinstance(key, int):
        try:
            return b"i%d;" % key
        except ValueError:  # more digits than int() may print: hexadecimal has no such limit
            return b"x%s;" % format(key, "x").encode()
    if isinstance(key, tuple):
        if depth >= MAX_KEY_DEPTH:
            raise ValueError(
                f"{backend} keys are tuples nested at most {MAX_KEY_DEPTH} deep; "
                "this key is nested deeper"
            )
        items = cast("tuple[object, ...]", key)
        return b"t%d:" % len(items) + b"".join(
            serialize_key(item, backend, depth + 1) for item in items
        )
    raise TypeError(
        f"{backend} keys must be str, bytes, int or tuples of them, not {type(key).__name__}"
    )


def deserialize_key(data: bytes) -> object:
    """The key that ``serialize_key`` turned into ``data``.

    Raises:
        ValueError: ``data`` is not a serialized key.
    """
    try:
        key, end = _read_key(data, 0, 0)
    except ValueError as exc:  # a missing separator, a bad number: one message for all
        raise ValueError(f"not a serialized key ({exc})") from None
    if end != len(data):
        raise ValueError("not a serialized key (bytes left over after the key)")
    return key


def _read_key(data: bytes, start: int, depth: int) -> tuple[object, int]:
    kind = data[start : start + 1]
    if kind in (b"i", b"x"):
        end = data.index(b";", start)
        return int(data[start + 1 : end], 10 if kind == b"i" else 16), end + 1
    colon = data.index(b":", start)
    size = int(data[start + 1 : colon])
    if kind == b"t":
        if depth >= MAX_KEY_DEPTH:
            raise ValueError(f"tuples nested deeper than {MAX_KEY_DEPTH}")
        items: list[object] = []
        position = colon + 1
        for _ in range(size):
            item, position = _read_key(data, position, depth + 1)
            items.append(item)
        return tuple(items), position
    end = colon + 1 + size
    if end > len(data) or kind not in (b"s", b"b"):
        raise ValueError("unknown kind or short data")
    body = data[colon + 1 : end]
    return (body.decode("utf-8", "surrogatepass") if kind == b"s" else body), end
