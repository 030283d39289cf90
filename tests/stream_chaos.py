"""Chaos run of KeyedStream: consumer processes killed, paused and joining while messages flow.

The parent publishes messages for many keys (each key's messages numbered 0, 1, 2, ...) to
one stream while consumer processes handle them. Each handler records its start and its
completion in a history list, through a script that refuses the record unless the handler's
``msg.fence`` is still its partition's owner's fence — the way an application's store would
refuse a stale owner's writes. Meanwhile the parent SIGKILLs consumers (a new one takes each
one's place), SIGSTOPs them (half of them well past the lease), and starts one more consumer
partway.
A few messages fail once (retried), a few always (dead-lettered); with ``--killers``, that many
messages kill the consumer process that runs them (``os._exit``), and the parent starts a new
consumer for each one that died so. Afterwards it checks:

* order: per key, no message started before every earlier message of the key had completed
  or was dead-lettered, and no start went back to an earlier message once a later one had
  started (a replay never runs behind newer work of its key);
* nothing lost: every message completed or was dead-lettered, and only the always-failing
  ones and the killers were dead-lettered (a killer once handed out more than
  ``max_deliveries`` times, and no message pending beside it); since a message is
  acknowledged only after it completed, an ack past unfinished work would show as a message
  that never completed;
* nothing left: once the consumers stopped gracefully, nothing is pending in any partition;
* no stale start: in each partition, no handler started (by an unfenced log of every start)
  with a fence older than one that had already started there; half the pauses last well
  past the lease, so that the paused consumer's partitions change owner meanwhile;
* duplicates (completions beyond the first, after a kill or a lost lease) are counted.

The test suite runs a small size (``test_stream_chaos.py``); the full size::

    python -m tests.stream_chaos --messages 20000 --keys 1000 --seed 1 --killers 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as redis_asyncio

from keyserial.streams import KeyedStream, RedisStreamSource, StreamMessage
from keyserial.streams._redis_source import entry_of

from .chaos_stacks import answer_stack_requests, stacks_of

ROOT = Path(__file__).resolve().parent.parent
STREAM = "chaos"
HISTORY = "chaos:history"
#: Every handler start, unfenced: ``partition|fence|pid``, in the order the starts reached
#: Redis; and ``resume|pid`` just before a paused consumer is let go on.
STARTS = "chaos:starts"

# KEYS: the partition's holder, the history. ARGV: fence, record.
# Appends the record only while ``fence`` is the partition owner's fence.
FENCED_RECORD = """
local holder = redis.call('GET', KEYS[1])
if holder and string.match(holder, ':(%d+)$') == ARGV[1] then
  redis.call('RPUSH', KEYS[2], ARGV[2])
  return 1
end
return 0
"""


class StaleOwner(Exception):
    """The handler's owner no longer holds the partition: its record was refused."""


# -- the consumer process ---------------------------------------------------------------------


async def consume(url: str, partitions: int, lease: float, seed: int, max_deliveries: int) -> None:
    client = redis_asyncio.Redis.from_url(url)
    stream = KeyedStream(client, STREAM, partitions, lease=lease)
    source = stream.source
    assert isinstance(source, RedisStreamSource)
    # The records' own client: handlers wait for one of its connections rather than fail.
    records = redis_asyncio.Redis(
        connection_pool=redis_asyncio.BlockingConnectionPool.from_url(url, max_connections=32)
    )
    record = records.register_script(FENCED_RECORD)
    # Synchronous, so that a start is recorded in the same step as the owner's check before
    # it: a record sent later (after an await) could arrive after a pause and tell nothing.
    starts = redis.Redis.from_url(url)
    rng = random.Random(seed)

    async def fenced(message: StreamMessage, what: str) -> None:
        holder = source.stream_name(message.partition).removesuffix(":stream") + ":holder"
        text = (
            f"{what}|{message.key}|{message.fields['seq']}|{message.id}|"
            f"{os.getpid()}:{message.fence % 100000}:{message.deliveries}:{message.attempt}"
        )
        if not await record(keys=[holder, HISTORY], args=[message.fence, text]):
            raise StaleOwner(f"fence {message.fence} no longer owns {message.partition}")

    @stream.consumer(
        max_in_flight=200,
        max_attempts=3,
        max_deliveries=max_deliveries,
        retry_delay=0.005,
        drain_timeout=10,
    )
    async def handle(message: StreamMessage) -> None:
        starts.rpush(STARTS, f"{message.partition}|{message.fence}|{os.getpid()}")
        await fenced(message, "S")
        if message.fields["fate"] == "killer":
            os._exit(3)  # as a crash in an extension would: no cleanup, no ack
        await asyncio.sleep(rng.random() * 0.002)
        fate = message.fields["fate"]
        if fate == "poison" or (fate == "flaky" and message.attempt == 1):
            raise RuntimeError(f"{fate} message")
        await fenced(message, "C")

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stream.stop)
    answer_stack_requests()  # a consumer that does not stop is asked where it is stuck
    print("ready", flush=True)
    await stream.run()
    await stream.aclose()
    await client.aclose()
    await records.aclose()
    starts.close()


# -- the parent -------------------------------------------------------------------------------


@dataclass
class Report:
    published: int = 0
    completed: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    faults: Counter[str] = field(default_factory=lambda: Counter[str]())
    problems: list[str] = field(default_factory=lambda: [])

    def summary(self) -> str:
        return (
            f"published {self.published}, completed {self.completed} "
            f"(+{self.duplicates} duplicates), dead-lettered {self.dead_lettered}, "
            f"faults {dict(self.faults)}, problems: {self.problems[:10] or 'none'}"
        )


class Chaos:
    """One chaos run (see the module docstring)."""

    def __init__(
        self,
        messages: int,
        keys: int,
        *,
        consumers: int = 4,
        partitions: int = 16,
        lease: float = 0.5,
        seed: int = 1,
        killers: int = 0,
        max_deliveries: int = 4,
        url: str,
    ) -> None:
        self.messages, self.keys = messages, keys
        self.killers, self.max_deliveries = killers, max_deliveries
        self.consumers, self.partitions, self.lease = consumers, partitions, lease
        self.rng = random.Random(seed)
        self.url = url
        self.redis = redis.Redis.from_url(url)
        # The stream's own names for its partitions' keys (no connection is made through it).
        self.names = RedisStreamSource(redis_asyncio.Redis.from_url(url), STREAM, partitions, lease)
        self.processes: list[subprocess.Popen[bytes]] = []
        self.gone: list[subprocess.Popen[bytes]] = []  # killed, their pipes still to close
        self.directory = Path(tempfile.mkdtemp(prefix="keyserial-stream-chaos-"))
        self.errors: dict[int, Path] = {}  # each consumer's stderr
        self.report = Report()
        self.fates: dict[tuple[str, int], str] = {}

    def spawn(self) -> None:
        errors = (self.directory / f"consumer-{len(self.processes) + len(self.gone)}.err").open(
            "wb"
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.stream_chaos", "consume", self.url,
             str(self.partitions), str(self.lease), str(self.rng.randrange(1 << 30)),
             str(self.max_deliveries)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=errors,
        )  # fmt: skip
        errors.close()
        self.errors[process.pid] = Path(errors.name)
        assert process.stdout is not None
        assert process.stdout.readline().strip() == b"ready"
        self.processes.append(process)

    def run(self, seconds: float = 120.0) -> Report:
        deadline = time.monotonic() + seconds
        try:
            for _ in range(self.consumers - 1):
                self.spawn()
            self.publish_and_inject(deadline)
            self.wait_until_done(deadline)
            self.stop_all()
            self.check()
        finally:
            for process in self.processes + self.gone:
                if process.poll() is None:
                    process.kill()
                process.wait()
                if process.stdout is not None:
                    process.stdout.close()
            self.redis.close()
            shutil.rmtree(self.directory, ignore_errors=True)
        return self.report

    def publish_and_inject(self, deadline: float) -> None:
        asyncio.run(self._publish_and_inject(deadline))

    async def _publish_and_inject(self, deadline: float) -> None:
        client = redis_asyncio.Redis.from_url(self.url)
        stream = KeyedStream(client, STREAM, self.partitions, lease=self.lease)
        sequence = [0] * self.keys
        batches = 20
        per_batch = self.messages // batches
        killers = set(self.rng.sample(range(batches * per_batch), self.killers))
        for batch in range(batches):
            for n in range(per_batch):
                key = self.rng.randrange(self.keys)
                seq, sequence[key] = sequence[key], sequence[key] + 1
                roll = self.rng.random()
                fate = "poison" if roll < 0.002 else "flaky" if roll < 0.012 else "ok"
                if batch * per_batch + n in killers:
                    fate = "killer"
                self.fates[(f"key-{key}", seq)] = fate
                await stream.publish(f"key-{key}", {"seq": seq, "fate": fate})
            self.report.published += per_batch
            self.replace_crashed()
            if batch == batches // 3:
                self.spawn()  # a consumer joins mid-run
                self.report.faults["joined"] += 1
            elif batch % 2 == 1:
                await self.fault()
            await asyncio.sleep(0.05)
            if time.monotonic() > deadline:
                break
        await client.aclose()

    def replace_crashed(self, *, respawn: bool = True) -> None:
        """Start a consumer in place of each one that a killer message ended."""
        for process in [p for p in self.processes if p.poll() is not None]:
            self.processes.remove(process)
            self.gone.append(process)
            if process.returncode == 3:
                self.report.faults["killed by a message"] += 1
            else:
                self.report.problems.append(f"consumer {process.pid} exited {process.returncode}")
            if respawn:
                self.spawn()

    async def fault(self) -> None:
        victim = self.rng.randrange(len(self.processes))
        process = self.processes[victim]
        if self.rng.random() < 0.5:
            process.kill()
            process.wait()
            self.gone.append(self.processes.pop(victim))
            self.spawn()  # a new consumer takes its place
            self.report.faults["killed"] += 1
        else:
            # Half the pauses end within the lease, half well past it: another consumer
            # takes the partitions over, and the paused one must start nothing on resuming.
            past = self.rng.random() < 0.5
            process.send_signal(signal.SIGSTOP)
            await asyncio.sleep(self.rng.uniform(2.0, 3.0) if past else self.rng.uniform(0.3, 0.9))
            self.redis.rpush(STARTS, f"resume|{process.pid}")  # before it can record anything
            process.send_signal(signal.SIGCONT)
            self.report.faults["paused past the lease" if past else "paused"] += 1

    def history(self) -> list[tuple[str, str, int, str]]:
        rows: list[tuple[str, str, int, str]] = []
        raws: Any = self.redis.lrange(HISTORY, 0, -1)
        for raw in raws:
            what, key, seq, message_id, by = raw.decode().split("|")
            rows.append((what, key, int(seq), message_id + " " + by))
        return rows

    def dead(self) -> set[tuple[str, int]]:
        found: set[tuple[str, int]] = set()
        for partition in range(self.partitions):
            rows: Any = self.redis.xrange(self.names.dead_letter_name(partition))
            for dead_id, fields in rows:
                letter = entry_of([dead_id, [part for pair in fields.items() for part in pair]], 1)
                assert isinstance(letter.key, str)
                found.add((letter.key, int(letter.fields["seq"])))
        return found

    def wait_until_done(self, deadline: float) -> None:
        expected = len(self.fates)
        while time.monotonic() < deadline:
            completed = {(key, seq) for what, key, seq, _ in self.history() if what == "C"}
            if len(completed | self.dead()) >= expected:
                return
            self.replace_crashed()
            time.sleep(0.2)
        self.report.problems.append("not every message was handled or dead-lettered in time")

    def stop_all(self) -> None:
        self.replace_crashed(respawn=False)  # killed by a message since the last look
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                stacks = stacks_of(process, self.errors[process.pid])
                self.report.problems.append(f"consumer {process.pid} did not stop: {stacks}")
            else:
                if process.returncode != 0:
                    self.report.problems.append(
                        f"consumer {process.pid} exited {process.returncode}"
                    )

    def stale_starts(self) -> list[str]:
        """Handler starts whose fence is older than one already started in their partition.

        One start per pause is let pass: the first record a consumer sends once it goes on.
        A handler whose owner checked its lease just before the pause came, and whose record
        was not yet sent, started in time, yet its record arrives after the new owner's. No
        consumer can make its check and a handler's first write one step, so that one is
        allowed; any further start with an old fence is not.
        """
        newest: dict[str, int] = {}
        first_after_pause: set[str] = set()
        stale: list[str] = []
        raws: Any = self.redis.lrange(STARTS, 0, -1)
        for raw in raws:
            fields = raw.decode().split("|")
            if fields[0] == "resume":
                first_after_pause.add(fields[1])
                continue
            partition, fence, pid = fields
            in_window = pid in first_after_pause
            first_after_pause.discard(pid)
            if int(fence) < newest.get(partition, 0) and not in_window:
                stale.append(f"partition {partition}: fence {fence} after {newest[partition]}")
            newest[partition] = max(int(fence), newest.get(partition, 0))
        return stale

    def check(self) -> None:
        report, history, dead = self.report, self.history(), self.dead()
        if stale := self.stale_starts():
            report.problems.append(f"handlers started with an old fence: {stale[:5]}")
        completed: dict[str, set[int]] = defaultdict(set)
        highest_start: dict[str, int] = {}
        completions = 0
        for what, key, seq, _ in history:
            if what == "S":
                earlier_open = [
                    n for n in range(seq) if n not in completed[key] and (key, n) not in dead
                ]
                if earlier_open:
                    trail = [(w, n, i) for w, k, n, i in history if k == key]
                    report.problems.append(
                        f"{key} #{seq} started before #{earlier_open[0]} ended: {trail}"
                        f" fates {[self.fates.get((key, n)) for n in range(seq + 1)]}"
                    )
                if seq < highest_start.get(key, -1) and seq in completed[key]:
                    report.problems.append(f"{key} #{seq} ran again after a later message started")
                highest_start[key] = max(seq, highest_start.get(key, -1))
            else:
                completions += 1
                completed[key].add(seq)
        report.completed = sum(map(len, completed.values()))
        report.duplicates = completions - report.completed
        report.dead_lettered = len(dead)
        poison = {message for message, fate in self.fates.items() if fate in ("poison", "killer")}
        if dead != poison:
            report.problems.append(
                f"dead letters {sorted(dead ^ poison)[:5]} differ from poison and killers"
            )
        lost = [
            message
            for message in self.fates
            if message not in dead and message[1] not in completed[message[0]]
        ]
        if lost:
            report.problems.append(f"{len(lost)} messages lost, e.g. {lost[:5]}")
        for partition in range(self.partitions):
            pending: Any = self.redis.xpending(self.names.stream_name(partition), "keyserial")
            if pending["pending"]:
                report.problems.append(f"partition {partition}: {pending['pending']} pending")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.stream_chaos", description=__doc__)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--lease", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--killers", type=int, default=0, help="messages that kill a consumer")
    parser.add_argument("--max-deliveries", type=int, default=4)
    options = parser.parse_args()
    from .redis_server import RedisServer, redis_server_binary

    server = RedisServer(redis_server_binary())
    server.start()
    try:
        report = Chaos(
            options.messages,
            options.keys,
            consumers=options.consumers,
            partitions=options.partitions,
            lease=options.lease,
            seed=options.seed,
            killers=options.killers,
            max_deliveries=options.max_deliveries,
            url=server.url,
        ).run(options.seconds)
    finally:
        server.close()
    print(report.summary())
    return 1 if report.problems else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["consume"]:
        url, partitions, lease, seed, max_deliveries = sys.argv[2:7]
        asyncio.run(consume(url, int(partitions), float(lease), int(seed), int(max_deliveries)))
    else:
        sys.exit(main())
