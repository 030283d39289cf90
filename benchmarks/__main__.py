"""Run every benchmark scenario against every baseline and print the tables.

python -m benchmarks                 # full sizes (a few minutes)
python -m benchmarks --quick         # tiny sizes: checks that the suite runs
python -m benchmarks --markdown docs/performance-results.md --plot docs/waiters.png
python -m benchmarks --headline --runs 3 --check   # the targets, over 3 processes
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

from . import report, scenarios
from .adapters import all_adapters


async def run(
    quick: bool, repeats: int, headline: bool
) -> tuple[list[scenarios.Table], dict[str, dict[int, float]]]:
    calls = 2_000 if quick else 200_000
    waiter_sizes = [500, 1_000, 2_000] if quick else [50_000, 100_000, 200_000]
    chain = (1, 10, 100) if quick else (1, 10, 100, 1_000)
    adapters = all_adapters()
    # The headline run measures only what the targets need, to be repeated in separate
    # processes (--runs): keyserial alone where a target reads only its own figures. The rows
    # nearest their limits (uncontended, decorated, contended) get more rounds there, in the
    # time the rest of the full run would take: on a shared machine one round's ratio moves by
    # up to a third (the contended one measured 1.19 to 1.93 in nine rounds of one process),
    # so a median of three rounds can land 0.1 off; of nine, about half as far.
    ours = [a for a in adapters if a.name == "keyserial"]
    rounds = _rounds_near_limits(repeats, headline)
    tables: list[scenarios.Table] = []
    if headline:
        targeted = [a for a in adapters if a.name in _UNCONTENDED_TARGETS]
        tables += await scenarios.uncontended(targeted, calls, rounds, one_key=False)
    else:
        tables += await scenarios.uncontended(adapters, calls, repeats)
    tables.append(await scenarios.decorated(calls, rounds))
    if headline:
        bare = [a for a in adapters if a.name in ("keyserial", "bare await")]
        tables += await scenarios.contended(bare, calls, rounds, (100,))
    else:
        tables += await scenarios.contended(adapters, calls, max(3, repeats // 2))
    tables.append(await scenarios.loop_served(calls // 10, repeats * 3))
    tables += await scenarios.multi_key(calls // 2, repeats)
    tables.append(await scenarios.deadlock_chain(200 if quick else 10_000, chain, repeats))
    tables.append(await scenarios.observability(calls, repeats))
    if not headline:
        tables.append(await scenarios.coalescing(calls // 2, max(3, repeats // 2)))
        tables.append(await scenarios.hand_off(adapters, calls // 4, repeats))
    waiting = ours if headline else [a for a in adapters if a.name != "bare await"]
    waiter_tables, curves = await scenarios.many_waiters(
        waiting, waiter_sizes, max(3, repeats // 2)
    )
    tables += waiter_tables
    idle_keys = 10_000 if quick else (100_000 if headline else 1_000_000)
    tables += await scenarios.memory(
        ours if headline else adapters, idle_keys, waiters=1_000 if quick else 100_000
    )
    return tables, curves


#: The adapters the uncontended targets compare keyserial with (see report.targets).
_UNCONTENDED_TARGETS = ("keyserial", "one asyncio.Lock", "defaultdict(Lock)", "asyncio-keyed-lock")


def _rounds_near_limits(repeats: int, headline: bool) -> int:
    """Rounds for the uncontended, decorated and contended rows: more in a headline run."""
    return 2 * repeats - 1 if headline else repeats


def _repeats_said(repeats: int, headline: bool) -> str:
    said = f"{repeats} interleaved repeats per variant"
    if headline:
        rounds = _rounds_near_limits(repeats, headline)
        said += f" ({rounds} for the uncontended, decorated and contended rows)"
    return said


def _runs_in_processes(
    runs: int, arguments: list[str], plot: Path | None
) -> tuple[list[list[report.Target]], str]:
    """Run the benchmark ``runs`` times, each in a process of its own: their targets, and
    the first run's report (its tables; with ``plot``, it draws the waiters plot too)."""
    results: list[list[report.Target]] = []
    first = ""
    with tempfile.TemporaryDirectory() as directory:
        for number in range(runs):
            path = Path(directory) / f"run-{number}.json"
            command = [sys.executable, "-m", "benchmarks", *arguments, "--json", str(path)]
            if number == 0 and plot is not None:
                command += ["--plot", str(plot)]
            print(f"run {number + 1} of {runs}: {' '.join(command[1:])}", flush=True)
            done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True)
            if number == 0:
                first = done.stdout
            results.append(report.load_targets(path))
    return results, first


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for CI smoke runs")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant")
    parser.add_argument("--markdown", type=Path, help="also write the report to this file")
    parser.add_argument("--plot", type=Path, help="write the waiters plot (PNG) here")
    parser.add_argument(
        "--headline", action="store_true", help="only the scenarios the targets read"
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat in this many separate processes; report each target's median and range",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if a target is missed by more than its noise margin",
    )
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)  # a run's targets
    options = parser.parse_args()
    repeats = options.repeats or (2 if options.quick else 5)
    waiter_sizes = [500, 1_000, 2_000] if options.quick else [50_000, 100_000, 200_000]
    command = "python -m benchmarks " + " ".join(sys.argv[1:])

    if options.runs > 1:
        arguments = ["--repeats", str(repeats)]
        arguments += ["--quick"] if options.quick else []
        arguments += ["--headline"] if options.headline else []
        results, first = _runs_in_processes(options.runs, arguments, options.plot)
        text = "\n\n".join(
            [
                f"Environment: {report.environment()}",
                f"Command: `{command.strip()}`: {options.runs} separate processes, each "
                f"with {_repeats_said(repeats, options.headline)}; median and range over "
                "the processes.",
                report.render_runs(results),
                "## The first of those runs, in full",
                first.strip(),
            ]
        )
        targets = report.median_targets(results)
    else:
        tables, curves = asyncio.run(run(options.quick, repeats, options.headline))
        targets = report.targets(tables, waiter_sizes)
        parts = [
            f"Environment: {report.environment()}",
            f"Command: `{command.strip()}`, {_repeats_said(repeats, options.headline)}, medians.",
            report.render_targets(targets),
            *(report.render(table) for table in tables),
        ]
        text = "\n\n".join(parts)
        if options.json:
            report.save_targets(targets, options.json)
        if options.plot:
            if report.plot(curves, options.plot):
                print(f"plot written to {options.plot}")
            else:
                print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
    print(text)
    if options.markdown:
        options.markdown.parent.mkdir(parents=True, exist_ok=True)
        options.markdown.write_text(text + "\n")
    missed = [t for t in targets if t.missed_beyond_noise]
    if options.check and missed:
        for target in missed:
            print(f"missed beyond noise: {target.claim}: {target.measured:.2f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
