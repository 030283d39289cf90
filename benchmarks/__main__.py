"""Run every benchmark scenario against every baseline and print the tables.

python -m benchmarks                 # full sizes (a few minutes)
python -m benchmarks --quick         # tiny sizes: checks that the suite runs
python -m benchmarks --markdown docs/performance-results.md --plot docs/waiters.png
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from . import report, scenarios
from .adapters import all_adapters


async def run(
    quick: bool, repeats: int
) -> tuple[list[scenarios.Table], dict[str, dict[int, float]]]:
    calls = 2_000 if quick else 200_000
    waiter_sizes = [500, 1_000, 2_000] if quick else [50_000, 100_000, 200_000]
    adapters = all_adapters()
    tables: list[scenarios.Table] = []
    tables += await scenarios.uncontended(adapters, calls, repeats)
    tables.append(await scenarios.decorated(calls, repeats))
    tables += await scenarios.contended(adapters, calls, max(3, repeats // 2))
    tables += await scenarios.multi_key(calls // 2, repeats)
    tables.append(await scenarios.observability(calls, repeats))
    tables.append(await scenarios.coalescing(calls // 2, max(3, repeats // 2)))
    tables.append(await scenarios.hand_off(adapters, calls // 4, repeats))
    waiter_tables, curves = await scenarios.many_waiters(
        [a for a in adapters if a.name != "bare await"], waiter_sizes, max(3, repeats // 2)
    )
    tables += waiter_tables
    tables += await scenarios.memory(
        adapters, idle_keys=10_000 if quick else 1_000_000, waiters=1_000 if quick else 100_000
    )
    return tables, curves


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for CI smoke runs")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per variant")
    parser.add_argument("--markdown", type=Path, help="also write the report to this file")
    parser.add_argument("--plot", type=Path, help="write the waiters plot (PNG) here")
    options = parser.parse_args()
    repeats = options.repeats or (2 if options.quick else 5)
    waiter_sizes = [500, 1_000, 2_000] if options.quick else [50_000, 100_000, 200_000]

    tables, curves = asyncio.run(run(options.quick, repeats))
    command = "python -m benchmarks " + " ".join(sys.argv[1:])
    parts = [
        f"Environment: {report.environment()}",
        f"Command: `{command.strip()}`, {repeats} interleaved repeats per variant, medians.",
        report.render_targets(report.targets(tables, waiter_sizes)),
        *(report.render(table) for table in tables),
    ]
    text = "\n\n".join(parts) + "\n"
    print(text)
    if options.markdown:
        options.markdown.parent.mkdir(parents=True, exist_ok=True)
        options.markdown.write_text(text)
    if options.plot:
        if report.plot(curves, options.plot):
            print(f"plot written to {options.plot}")
        else:
            print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
