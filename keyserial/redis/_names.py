"""Names in Redis: user keys encoded so that no two collide, namespaces, and the ACL they need."""

from __future__ import annotations

import base64
import hashlib

from .._keycodec import MAX_KEY_DEPTH as MAX_KEY_DEPTH
from .._keycodec import serialize_key

#: Encoded keys longer than this are replaced by their SHA-256, so Redis key names stay short.
MAX_ENCODED_KEY = 200


def encode_key(key: object) -> str:
    """The Redis-safe name of ``key``: distinct keys never share a name.

    The key is serialized with its type and length, so ``"1"``, ``1``,
    ``b"1"`` and ``("1",)`` all differ, then written in URL-safe base64, which
    has no character that could end the hash tag or leave the namespace. Long
    keys are replaced by their SHA-256 (prefixed so that no short key's name
    can equal a hashed one).

    Raises:
        TypeError: ``key`` is not a str, bytes, int or a tuple of them.
        ValueError: tuples in ``key`` nest deeper than ``MAX_KEY_DEPTH``.

    Example:
        ```pycon
        >>> encode_key("seg-1") != encode_key(b"seg-1")
        True

        ```
    """
    data = serialize_key(key, "RedisKeyedQueue")
    if len(data) > MAX_ENCODED_KEY:
        return "h" + hashlib.sha256(data).hexdigest()
    return "k" + base64.urlsafe_b64encode(data).decode().rstrip("=")


def encoded_namespace(namespace: str) -> str:
    """``namespace`` as it appears in Redis names: URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(namespace.encode()).decode().rstrip("=")


#: Commands the queue sends, and those its scripts run (ACLs apply inside scripts too).
_COMMANDS = (
    "evalsha eval subscribe unsubscribe ping config|get "
    "get set del exists llen lpop lpos lrem rpush pexpire time publish zadd zrem zscore"
)


def acl_rules(namespace: str) -> str:
    """The ACL rules a Redis user needs to run a ``RedisKeyedQueue`` of ``namespace``.

    The keys of the namespace (its name is base64-encoded in them), the grant channels,
    and the commands the queue and its scripts use; ``config|get`` only lets the queue
    check ``maxmemory-policy`` at start-up, and may be left out.

    Example:
        ```pycon
        >>> acl_rules("transcripts").split()[:2]
        ['resetkeys', '~keyserial:{dHJhbnNjcmlwdHM:*']

        ```
    """
    commands = " ".join(f"+{command}" for command in _COMMANDS.split())
    return (
        f"resetkeys ~keyserial:{{{encoded_namespace(namespace)}:* resetchannels "
        f"&keyserial:grants:* -@all +hello +auth {commands}"
    )


def base_name(namespace: str, encoded: str) -> str:
    """The name the scripts derive a key's Redis keys from; its braces are a hash tag.

    ``namespace`` is already encoded (``encoded_namespace``), ``encoded`` is ``encode_key``'s.
    """
    return f"keyserial:{{{namespace}:{encoded}}}"
