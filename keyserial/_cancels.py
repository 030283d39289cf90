"""Taking back a cancellation keyserial requested, without swallowing anyone else's.

keyserial cancels a caller's task itself in two places: when a request to Redis outlives
its deadline or the lease, and when a turn's lease is lost while its function runs. It
then raises its own error (``TimeoutError``, ``RedisUnavailable``, ``LeaseLost``) instead
of the ``CancelledError``, and takes its cancellation back with ``Task.uncancel``. If the
task was cancelled from elsewhere in the same loop iteration, that cancellation must still
end the task: as ``asyncio.timeout`` does, the count of pending cancellations is compared
with the one before keyserial's, and the ``CancelledError`` goes on when it is higher.
Python 3.10 keeps no such count, and cannot tell the two apart.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any


def cancel_count(task: asyncio.Task[Any]) -> int:
    """The cancellations pending on ``task``: taken before keyserial may cancel it."""
    if sys.version_info < (3, 11):
        return 0
    return task.cancelling()


def withdraw_cancel(task: asyncio.Task[Any], before: int) -> bool:
    """Take back keyserial's cancellation of ``task``; False if another one is pending.

    ``before`` is ``cancel_count(task)`` from before keyserial could cancel it. On False,
    the caller lets the ``CancelledError`` propagate.
    """
    if sys.version_info < (3, 11):
        return True
    return task.uncancel() <= before
