"""Which partitions a consumer should own, given the live consumers: the same answer everywhere."""

from __future__ import annotations

from collections.abc import Sequence


def assigned(partitions: int, members: Sequence[str], member: str) -> frozenset[int]:
    """The partitions ``member`` should own among ``members`` (sorted the same everywhere).

    Partitions are dealt round-robin over the members in sorted order, so each owns
    ``partitions // len(members)`` or one more. A member not (yet) among them owns none.

    Example:
        ```pycon
        >>> sorted(assigned(5, ["a", "b"], "b"))
        [1, 3]

        ```
    """
    if member not in members:
        return frozenset()
    index, count = members.index(member), len(members)
    return frozenset(range(index, partitions, count))
