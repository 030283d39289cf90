"""Advisory-lock ids: a stable 64-bit hash of a key within its namespace."""

from __future__ import annotations

import hashlib

from .._keycodec import serialize_key

#: The advisory lock taken while the queue's or the streams' objects are created (by
#: whichever process is first).
SETUP_LOCK = 0x6B65797365726961  # "keyseria"


def lock_id(namespace: str, key: object) -> int:
    """The advisory-lock id of ``key`` in ``namespace``: the same in every process.

    The key is serialized with its type (so ``"1"``, ``1`` and ``b"1"`` differ) and hashed
    with BLAKE2b to a signed 64-bit integer, what ``pg_advisory_xact_lock(bigint)`` takes.
    Two keys whose ids collide (one chance in 2**64 per pair) only serialize with each
    other; nothing else goes wrong.

    Raises:
        ValueError: ``namespace`` contains a NUL character (it ends the namespace in the
            hashed bytes, so ``"a\\0b"`` would share ids with namespace ``"a"``).
        TypeError: ``key`` is not a str, bytes, int or a tuple of them.
        ValueError: tuples in ``key`` nest too deep.

    Example:
        ```pycon
        >>> lock_id("transcripts", "seg-1") == lock_id("transcripts", "seg-1")
        True
        >>> lock_id("transcripts", "seg-1") != lock_id("other", "seg-1")
        True

        ```
    """
    if "\0" in namespace:
        raise ValueError(f"namespace must not contain a NUL character, got {namespace!r}")
    data = namespace.encode() + b"\0" + serialize_key(key, "PostgresKeyedQueue")
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
