"""Markdown tables, target checks and the waiters plot."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .scenarios import Table


def environment() -> str:
    processor = platform.processor() or platform.machine()
    return (
        f"Python {platform.python_version()} ({platform.python_implementation()}), "
        f"{platform.system()} {platform.release()}, {processor}, {os.cpu_count()} CPUs"
    )


def step_table(
    title: str, seconds: Mapping[str, float], calls: int, baseline: str, command: str
) -> list[str]:
    """A step-by-step benchmark's report: ns per call and each variant's ratio to ``baseline``."""
    base = seconds[baseline]
    lines = [
        f"Environment: {environment()}",
        "",
        f"Command: `{command}`",
        "",
        f"### {title}",
        "",
        f"| variant | ns/call | ÷ {baseline} |",
        "|---|---:|---:|",
    ]
    for name, value in seconds.items():
        lines.append(f"| {name} | {value / calls * 1e9:,.0f} | {value / base:.2f} |")
    return lines


def _format(value: float) -> str:
    if abs(value) < 0.05:
        return "0"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.1f}"


def render(table: Table) -> str:
    reference = table.values.get(table.reference)
    show_ratio = (
        table.ratios and reference is not None and all(v > 0 for v in table.values.values())
    )
    header = f"| variant | {table.unit} |" + (
        f" {table.reference} ÷ variant |" if show_ratio else ""
    )
    rule = "|---|---:|" + ("---:|" if show_ratio else "")
    lines = [f"### {table.title}", "", header, rule]
    for name, value in table.values.items():
        row = f"| {name} | {_format(value)} |"
        if show_ratio and reference is not None:
            row += f" {reference / value:.2f} |"
        lines.append(row)
    lines.extend(f"\n{note}" for note in table.notes)
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    """A claim with its limit; ``margin``: how far above the limit is still run-to-run noise."""

    claim: str
    measured: float
    limit: float
    margin: float = 0.0

    @property
    def met(self) -> bool:
        return self.measured <= self.limit

    @property
    def missed_beyond_noise(self) -> bool:
        return self.measured > self.limit + self.margin


#: Run-to-run noise of a ratio of two timings on a quiet machine (measured: the medians of
#: separate processes spread by about this much).
RATIO_NOISE = 0.05


def _ratio(claim: str, measured: float, limit: float) -> Target:
    return Target(claim, measured, limit, round(limit * RATIO_NOISE, 3))


def targets(tables: Sequence[Table], waiter_sizes: Sequence[int]) -> list[Target]:
    """The performance targets, each checked against this run's tables.

    The first rows are a guard for the readable core (docs/performance.md gives the figures
    they were set from): a change may cost a little, not much.
    """
    by_id = {table.id: table.values for table in tables}
    growth = {table.id: table.growth for table in tables}
    results: list[Target] = []
    if "uncontended-distinct-keys" in by_id:
        v = by_id["uncontended-distinct-keys"]
        # Relaxed when the core began to keep a record of every turn (keyserial._turns):
        # the record's cost was accepted against reading frames (docs/performance.md).
        results += [
            _ratio(
                "uncontended run ÷ one asyncio.Lock", v["keyserial"] / v["one asyncio.Lock"], 1.15
            ),
            _ratio(
                "uncontended run ÷ defaultdict(Lock)",
                v["keyserial"] / v["defaultdict(Lock)"],
                0.75,
            ),
        ]
        if "asyncio-keyed-lock" in v:
            ratio = v["keyserial"] / v["asyncio-keyed-lock"]
            results.append(_ratio("uncontended run ÷ asyncio-keyed-lock", ratio, 0.2))
    if "decorated" in by_id:
        v = by_id["decorated"]
        run = v["queue.run(key, fn, key)"]
        results.append(
            _ratio("@serialized function ÷ queue.run", v["@serialized function"] / run, 1.75)
        )
        results.append(
            _ratio(
                "@serialized method ÷ queue.run",
                v["@serialized method"] / run,
                2.25,
            )
        )
    if "contended-100" in by_id:
        v = by_id["contended-100"]
        results.append(
            _ratio(
                "gather over 100 keys ÷ bare gather, fn yields once",
                v["keyserial"] / v["bare await"],
                1.55,
            )
        )
    if "contended-100-noop" in by_id:
        v = by_id["contended-100-noop"]
        ratio = v["keyserial"] / v["bare await"]
        results.append(
            _ratio("gather over 100 keys ÷ bare gather, fn returns at once", ratio, 1.25)
        )
    if "loop-after-use" in by_id:
        v = by_id["loop-after-use"]
        ratio = v["loop keyserial has served"] / v["fresh loop"]
        results.append(
            _ratio("bare gather on a loop keyserial served ÷ on a fresh loop", ratio, 1.05)
        )
    if "deadlock-check" in by_id:
        v = by_id["deadlock-check"]
        ratio = v["deadlock detection on (default)"] / v["detect_deadlocks=False"]
        results.append(_ratio("contended traffic with ÷ without the deadlock check", ratio, 1.05))
    if "deadlock-chain" in by_id:
        v = by_id["deadlock-chain"]
        if "chain of 100" in v:
            ratio = v["chain of 100"] / v["chain of 1"]
            results.append(
                Target("registration behind a chain of 100 ÷ of 1 holder", ratio, 2.0, 0.2)
            )
    if "observability" in by_id:
        v = by_id["observability"]
        ratio = v["queue.run, no observer"] / v["run before stats() (reference)"]
        results.append(Target("uncontended run, no observer ÷ before stats()", ratio, 1.03, 0.02))
    # Bytes are slopes over many keys or waiters: a fraction of a byte is a fixed allocation
    # spread over them, so they are compared in whole bytes.
    if "memory-idle" in by_id:
        idle = round(by_id["memory-idle"]["keyserial"])
        results.append(Target("bytes retained per idle key", idle, 0))
    if "memory-waiting" in by_id:
        extra = round(by_id["memory-waiting"]["difference"])
        results.append(Target("bytes per waiting call beyond an Event waiter", extra, 224))
    if "waiters-cancel-half" in growth and len(waiter_sizes) >= 2:
        linear = waiter_sizes[-1] / waiter_sizes[-2]
        measured = growth["waiters-cancel-half"]["keyserial"]
        results.append(
            Target(
                f"cancel half: {waiter_sizes[-1]:,} run ÷ {waiter_sizes[-2]:,} run",
                measured,
                round(linear * 1.15, 2),
                round(linear * 0.05, 2),
            )
        )
    return results


def _mark(target: Target) -> str:
    if target.met:
        return "met"
    return "**missed**" if target.missed_beyond_noise else "missed, within noise"


def render_targets(results: Sequence[Target]) -> str:
    lines = ["### Targets", "", "| claim | measured | target | |", "|---|---:|---:|---|"]
    for target in results:
        measured = round(target.measured, 2) + 0.0  # no "-0.00" for a slope of zero
        lines.append(f"| {target.claim} | {measured:.2f} | ≤ {target.limit:g} | {_mark(target)} |")
    return "\n".join(lines)


def save_targets(results: Sequence[Target], path: Path) -> None:
    path.write_text(json.dumps([dataclasses.asdict(target) for target in results]))


def load_targets(path: Path) -> list[Target]:
    return [Target(**fields) for fields in json.loads(path.read_text())]


def median_targets(runs: Sequence[Sequence[Target]]) -> list[Target]:
    """Each target with the median of its measurements over ``runs``."""
    first = runs[0]
    claims = [target.claim for target in first]
    if any([target.claim for target in run] != claims for run in runs):
        raise ValueError("the runs measured different targets: rerun them on one version")
    return [
        dataclasses.replace(target, measured=statistics.median(run[i].measured for run in runs))
        for i, target in enumerate(first)
    ]


def render_runs(runs: Sequence[Sequence[Target]]) -> str:
    """The targets over several runs: median, range, and the verdict on the median."""
    lines = [
        f"### Targets over {len(runs)} runs",
        "",
        "| claim | median | range | target | |",
        "|---|---:|---:|---:|---|",
    ]
    for i, target in enumerate(median_targets(runs)):
        values = [run[i].measured for run in runs]
        spread = f"{min(values) + 0.0:.2f} to {max(values) + 0.0:.2f}"
        lines.append(
            f"| {target.claim} | {target.measured + 0.0:.2f} | {spread} | ≤ {target.limit:g} "
            f"| {_mark(target)} |"
        )
    return "\n".join(lines)


def plot(curves: dict[str, dict[int, float]], path: Path) -> bool:
    """Cost per call versus number of waiters; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    # Two panels (waiters that all wait, and half of them cancelled) on a log scale: the
    # baselines span two orders of magnitude, and a linear axis flattens keyserial's lines.
    figure: Any
    panels: Any
    figure, panels = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    for panel, cancelled in zip(panels, (False, True), strict=True):
        for name, points in curves.items():
            if ("none cancelled" in name) == cancelled:
                continue
            sizes = sorted(points)
            panel.plot(sizes, [points[s] for s in sizes], marker="o", label=name.split(" (")[0])
        panel.set_xlabel("waiters queued on one key")
        panel.set_yscale("log")
        panel.set_title("half cancelled before their turn" if cancelled else "none cancelled")
        panel.grid(True, which="both", alpha=0.3)
        panel.legend(fontsize=8)
    panels[0].set_ylabel("ns per waiting call (log scale)")
    figure.suptitle(f"Cost per call versus number of waiters (Python {sys.version.split()[0]})")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
