"""Keys serialized for the distributed backends and streams read back, and only those."""

from __future__ import annotations

import pytest

from keyserial._keycodec import deserialize_key, serialize_key


def test_serialized_keys_read_back() -> None:
    keys: list[object] = ["", "é\udc80", b"\x00", 0, -(10**5000), ("a", (1, b""), ()), (((),),)]
    for key in keys:
        assert deserialize_key(serialize_key(key, "test")) == key


@pytest.mark.parametrize(
    "data",
    [b"", b"s5:ab", b"i12", b"q1:a", b"s1:ab", b"t2:i1;", b"t1:" * 10_000 + b"t0:"],
    ids=["empty", "short", "unterminated", "unknown kind", "left over", "short tuple", "deep"],
)
def test_anything_else_is_a_value_error(data: bytes) -> None:
    # Deeper than any key may be nest, and than the stack: a ValueError, not a RecursionError.
    with pytest.raises(ValueError, match=r"^not a serialized key \("):
        deserialize_key(data)
