"""keyserial: serialize async work per key.

Calls with the same key run one at a time in registration order; calls with
different keys run concurrently. See [KeyedSerialQueue][keyserial.KeyedSerialQueue] and
[serialized][keyserial.serialized].
"""

from ._decorator import serialized
from ._errors import DeadlockError, LeaseLost, QueueClosed, QueueFull, Superseded
from ._fence import current_fence
from ._observation import QueueObserver
from ._options import MultiKeyWaitOptions, WaitOptions
from ._protocols import KeyLock, MultiKeySerialQueue, SerialQueue
from ._queue import KeyedSerialQueue, default_queue
from ._stats import QueueStats

__all__ = [
    "DeadlockError",
    "KeyLock",
    "KeyedSerialQueue",
    "LeaseLost",
    "MultiKeySerialQueue",
    "MultiKeyWaitOptions",
    "QueueClosed",
    "QueueFull",
    "QueueObserver",
    "QueueStats",
    "SerialQueue",
    "Superseded",
    "WaitOptions",
    "current_fence",
    "default_queue",
    "serialized",
]
__version__ = "0.1.0"
