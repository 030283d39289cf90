"""A keyed serial queue shared by processes and machines through Redis.

Extra: ``pip install "keyserial[redis]"``. See
[RedisKeyedQueue][keyserial.redis.RedisKeyedQueue].

The modules: ``_queue`` (the queue), ``_turns`` (acquire, wait, renew and release a turn in
Redis), ``_lease`` (the lease keeper), ``_grants`` (the grant listener), ``_lock`` (lock
blocks), ``_names`` (key encoding and ACLs), ``_scripts`` (the Lua scripts) and
``_transport`` (script calls on connections of the client's pool).
"""

from ._names import MAX_ENCODED_KEY, MAX_KEY_DEPTH, acl_rules, encode_key
from ._queue import MIN_LEASE, RedisKeyedQueue
from ._transport import RedisUnavailable

__all__ = [
    "MAX_ENCODED_KEY",
    "MAX_KEY_DEPTH",
    "MIN_LEASE",
    "RedisKeyedQueue",
    "RedisUnavailable",
    "acl_rules",
    "encode_key",
]
