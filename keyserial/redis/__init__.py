"""A keyed serial queue shared by processes and machines through Redis.

Extra: ``pip install "keyserial[redis]"``. See
[RedisKeyedQueue][keyserial.redis.RedisKeyedQueue].

The modules: ``_queue`` (the queue), ``_turns`` (acquire, wait, renew and release a turn in
Redis), ``_lease`` (the lease keeper), ``_grants`` (the grant listener), ``_lock`` (lock
blocks), ``_names`` (key encoding and ACLs), ``_scripts`` (the Lua scripts) and
``_transport`` (script calls on connections of the client's pool).
"""

from .._extras import require_extra

require_extra("keyserial.redis", "redis", "redis")
from ._names import MAX_ENCODED_KEY as MAX_ENCODED_KEY
from ._names import MAX_KEY_DEPTH as MAX_KEY_DEPTH
from ._names import acl_rules, encode_key
from ._queue import MIN_LEASE as MIN_LEASE
from ._queue import RedisKeyedQueue
from ._transport import RedisUnavailable

__all__ = [
    "RedisKeyedQueue",
    "RedisUnavailable",
    "acl_rules",
    "encode_key",
]
