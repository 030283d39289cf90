"""The process-wide queue that ``@serialized`` uses when given none."""

from __future__ import annotations

from ._queue import KeyedSerialQueue

_DEFAULT_QUEUE = KeyedSerialQueue()


def default_queue() -> KeyedSerialQueue:
    """Return the process-wide queue shared by every ``@serialized`` function given no ``queue``.

    Like every [KeyedSerialQueue][keyserial.KeyedSerialQueue], it behaves as if each event loop had
    its own queue: work, keys and the closed state of one loop never affect
    another, so ``asyncio.run`` after ``asyncio.run`` (or a test framework's
    loop per test) starts from a clean queue.

    Example:
        ```pycon
        >>> from keyserial import default_queue
        >>> default_queue() is default_queue()
        True

        ```
    """
    return _DEFAULT_QUEUE
