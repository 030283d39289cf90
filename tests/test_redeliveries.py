"""Which claimed messages are charged with a delivery, and which run alone (no broker)."""

from __future__ import annotations

from keyserial.streams._redeliveries import Redeliveries
from keyserial.streams._source import Entry


def entry(id: str, key: str, deliveries: int) -> Entry:
    return Entry(id, key, {}, deliveries)


def test_followers_of_a_key_are_not_charged_and_heads_are() -> None:
    counts = Redeliveries(max_deliveries=20)
    kept, corrected = counts.recount(
        [entry("1-0", "a", 2), entry("2-0", "a", 2), entry("3-0", "b", 2)]
    )
    assert [e.deliveries for e in kept] == [2, 1, 2]
    assert corrected == [("2-0", 1)]
    assert counts.suspects == set()  # a first redelivery is replayed concurrently


def test_a_key_seen_on_an_earlier_page_keeps_its_followers_uncharged() -> None:
    counts = Redeliveries(max_deliveries=20)
    counts.recount([entry("1-0", "a", 2)])
    kept, corrected = counts.recount([entry("2-0", "a", 5)])
    assert (kept[0].deliveries, corrected) == (4, [("2-0", 4)])


def test_of_the_last_owners_suspects_only_the_first_is_charged() -> None:
    # The last owner ran its suspects (handed out 3 times or more) one at a time in stream
    # order, so only the first one still pending can have been running when it died.
    counts = Redeliveries(max_deliveries=20)
    kept, corrected = counts.recount(
        [
            entry("1-0", "fresh", 2),  # read fresh by the last owner: charged
            entry("2-0", "pill", 4),  # its first pending suspect: charged
            entry("3-0", "waited", 4),  # a suspect behind it: never started
            entry("4-0", "pill", 4),  # a follower
        ]
    )
    assert [e.deliveries for e in kept] == [2, 4, 3, 3]
    assert corrected == [("3-0", 3), ("4-0", 3)]
    assert counts.suspects == {"2-0", "3-0"}  # heads handed out 3 times or more


def test_with_a_low_bound_every_redelivered_head_runs_alone() -> None:
    counts = Redeliveries(max_deliveries=2)
    counts.recount([entry("1-0", "a", 2), entry("2-0", "b", 1)])
    assert counts.suspects == {"1-0"}
    assert counts.solo_from == 2
    assert Redeliveries(max_deliveries=1).solo_from == 2  # a first read never ran alone
    assert Redeliveries(max_deliveries=None).solo_from == 3


def test_malformed_entries_are_left_as_they_are() -> None:
    counts = Redeliveries(max_deliveries=20)
    broken = Entry("1-0", None, {}, 7, malformed="no key")
    kept, corrected = counts.recount([broken])
    assert (kept, corrected, counts.suspects) == ([broken], [], set())


def test_a_message_is_refused_only_when_handed_out_more_than_max_deliveries_times() -> None:
    assert Redeliveries(max_deliveries=3).refusal(entry("1-0", "a", 3)) is None
    refusal = Redeliveries(max_deliveries=3).refusal(entry("1-0", "a", 4))
    assert refusal is not None
    assert refusal.startswith("delivered 4 times, more than max_deliveries=3")
    assert Redeliveries(max_deliveries=None).refusal(entry("1-0", "a", 1000)) is None
