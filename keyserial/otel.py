"""OpenTelemetry metrics for keyserial queues (extra: ``pip install "keyserial[otel]"``).

Example:
    ```pycon
    >>> from keyserial import KeyedSerialQueue
    >>> from keyserial.otel import OpenTelemetryObserver
    >>> queue = KeyedSerialQueue(observer=OpenTelemetryObserver())

    ```
"""

from __future__ import annotations

from collections.abc import Hashable

from ._extras import require_extra

require_extra("keyserial.otel", "otel", "opentelemetry")
from opentelemetry import metrics  # noqa: E402

from ._observation import Outcome, QueueObserver  # noqa: E402

__all__ = ["OpenTelemetryObserver"]


class OpenTelemetryObserver(QueueObserver):
    """A [QueueObserver][keyserial.QueueObserver] that records OpenTelemetry metrics.

    Instruments (all with a ``function`` attribute, the called function's
    qualified name; never the key, so that cardinality stays bounded):

    * ``keyserial.wait_time`` — histogram, seconds from registration to start;
    * ``keyserial.run_time`` — histogram, seconds from start to finish;
    * ``keyserial.waiting_calls`` — up/down counter of registered calls not started yet;
    * ``keyserial.calls`` — counter of finished calls, with an ``outcome``
      attribute: ``completed``, ``failed``, ``cancelled``, ``timed_out``,
      ``rejected`` or ``superseded``.

    Args:
        meter: the meter to create the instruments on; by default the global
            meter provider's meter named ``keyserial``.

    Example:
        ```pycon
        >>> from keyserial.otel import OpenTelemetryObserver
        >>> observer = OpenTelemetryObserver()

        ```
    """

    def __init__(self, meter: metrics.Meter | None = None) -> None:
        meter = meter or metrics.get_meter("keyserial")
        self._wait_time = meter.create_histogram(
            "keyserial.wait_time", unit="s", description="Time calls waited for their turn"
        )
        self._run_time = meter.create_histogram(
            "keyserial.run_time", unit="s", description="Time calls held their turn"
        )
        self._waiting = meter.create_up_down_counter(
            "keyserial.waiting_calls", description="Calls registered and not started yet"
        )
        self._calls = meter.create_counter(
            "keyserial.calls", description="Calls finished, by outcome"
        )

    def on_register(self, key: Hashable, function: str) -> None:
        self._waiting.add(1, {"function": function})

    def on_start(self, key: Hashable, function: str, waited: float) -> None:
        attributes = {"function": function}
        self._waiting.add(-1, attributes)
        self._wait_time.record(waited, attributes)

    def on_finish(
        self, key: Hashable, function: str, waited: float, ran: float | None, outcome: Outcome
    ) -> None:
        if ran is None:
            self._waiting.add(-1, {"function": function})  # it never started
        else:
            self._run_time.record(ran, {"function": function})
        self._calls.add(1, {"function": function, "outcome": outcome})
