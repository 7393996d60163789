"""The results: a table of medians with their range and the ratios, as text, JSON and markdown."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from bench.core import Outcome

DASH = "\u2013"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
    try:
        meminfo = Path("/proc/meminfo").read_text()
        kb = int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal")))
        info["memory_gib"] = round(kb / 1024 / 1024, 1)
    except (OSError, StopIteration, ValueError):
        pass
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(
            line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line
        )
    except (OSError, StopIteration):
        pass
    return info


def revision() -> str:
    """The commit measured, and whether the work tree differed from it."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                "controlplane",
                "reconciler",
                "provisioners",
            ],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} (with uncommitted changes)" if dirty else head


def revision_line(meta: dict[str, Any]) -> str:
    start, end = meta.get("revision", "unknown"), meta.get("revision_end", meta.get("revision", "unknown"))
    if start == end:
        return f"- Product revision: {start}."
    return (
        f"- Product revision: {start} at the start, {end} at the end: the product changed during the run "
        "(each driver runs the code of the moment it starts)."
    )


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def fmt(value: float | None, decimals: int = 0) -> str:
    if value is None:
        return DASH
    return f"{value:,.{decimals}f}"


def rows(outcomes: list[Outcome]) -> list[list[str]]:
    """One row per (workload, variant, metric), then one per target."""
    table: list[list[str]] = []
    for outcome in outcomes:
        workload = outcome.workload
        title = workload.title
        if outcome.unavailable:
            table.append([title, "", "not available", "", "", outcome.unavailable])
            continue
        for variant in workload.variants:
            for metric in workload.metrics.get(variant, ()):
                values = outcome.values(variant, metric.key)
                if not values:
                    table.append([title, variant, metric.label, "no result", "", ""])
                    title = ""
                    continue
                span = f"{fmt(min(values), metric.decimals)}{DASH}{fmt(max(values), metric.decimals)}"
                med = fmt(statistics.median(values), metric.decimals)
                table.append([title, variant, metric.label, med, span, f"n={len(values)}"])
                title = ""
        for target in workload.targets:
            value = outcome.target_value(target)
            paired = outcome.paired_ratios(target)
            span = f"{min(paired):.2f}{DASH}{max(paired):.2f}" if paired and target.denominator else ""
            verdict = "" if value is None else ("met" if target.met(value) else "MISSED")
            shown = DASH if value is None else f"{value:.2f}"
            table.append(
                [title, "target", target.label, shown, span, f"{target.describe()} {verdict}".strip()]
            )
            title = ""
        if outcome.errors:
            table.append([title, "errors", str(len(outcome.errors)), outcome.errors[0][:80], "", ""])
    return table


HEADER = ["workload", "variant", "metric", "median", f"min{DASH}max", ""]


def text_table(outcomes: list[Outcome]) -> str:
    body = rows(outcomes)
    widths = [max(len(r[i]) for r in [HEADER, *body]) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(HEADER))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in body]
    return "\n".join(lines)


def markdown_table(outcomes: list[Outcome]) -> str:
    lines = ["| " + " | ".join([*HEADER[:-1], "note"]) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in rows(outcomes)]
    return "\n".join(lines)


def as_json(outcomes: list[Outcome], meta: dict[str, Any]) -> dict[str, Any]:
    workloads: dict[str, Any] = {}
    for outcome in outcomes:
        w = outcome.workload
        entry: dict[str, Any] = {
            "title": w.title,
            "notes": w.notes,
            "errors": outcome.errors,
            "stolen_pct": outcome.stolen,
        }
        if outcome.unavailable:
            entry["not_available"] = outcome.unavailable
        entry["variants"] = {
            variant: {
                key: {
                    "samples": values,
                    "median": statistics.median(values),
                    "min": min(values),
                    "max": max(values),
                }
                for key, values in metrics.items()
                if values
            }
            for variant, metrics in outcome.samples.items()
        }
        entry["targets"] = [
            {
                "label": t.label,
                "value": outcome.target_value(t),
                "paired": outcome.paired_ratios(t),
                "target": t.describe(),
                "met": None if outcome.target_value(t) is None else t.met(outcome.target_value(t) or 0.0),
            }
            for t in w.targets
        ]
        workloads[w.key] = entry
    return {**meta, "workloads": workloads}


def markdown(outcomes: list[Outcome], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    pg = meta["postgres"]
    settings = ", ".join(f"{k}={v}" for k, v in pg.items() if k not in {"version", "server_version"})
    lines = [
        "# Benchmark results (latest run)",
        "",
        f"- Run: {meta['started_at']} ({meta['duration_s']:.0f} s), command `{meta['command']}`, "
        f"{meta['repeat']} repetitions, interleaved; {'quick sizes' if meta['quick'] else 'full sizes'}.",
        f"- Conditions: {meta['conditions']}",
        revision_line(meta),
        f"- Load average (1, 5, 15 min) at start {meta['load_start']}, at end {meta['load_end']}.",
        f"- Machine: {m.get('cores')} cores ({m.get('cpu', '?')}), {m.get('memory_gib', '?')} GiB, "
        f"Linux {m.get('kernel')}, Python {m.get('python')}.",
        f"- PostgreSQL: {pg.get('version')}",
        f"- Settings: {settings}",
        "",
        "Medians over the repetitions, with the range; targets are reported, never asserted. "
        "A ratio's range is over the per-repetition ratios (the variants ran back to back).",
        "",
        markdown_table(outcomes),
        "",
        "## Notes",
        "",
    ]
    for outcome in outcomes:
        w = outcome.workload
        for note in w.notes:
            lines.append(f"- **{w.title}**: {note}")
        if outcome.stolen:
            lines.append(f"- **{w.title}**: {stolen_note(outcome.stolen)}")
        for error in outcome.errors[:3]:
            lines.append(f"- **{w.title}** error: `{error[:300]}`")
    return "\n".join(lines) + "\n"


def stolen_note(stolen: dict[str, list[float]]) -> str:
    """The host's steal while each variant ran: a figure measured while the host took much of the
    CPU measures the host as much as the product."""
    shown = "; ".join(
        f"{variant} {', '.join(f'{v:.0f}' for v in values)}" for variant, values in stolen.items()
    )
    return (
        "CPU stolen by the host while each variant ran (% of the machine, /proc/stat, per repetition): "
        + shown
    )


def write(results_dir: Path, outcomes: list[Outcome], meta: dict[str, Any]) -> tuple[Path, Path]:
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = meta["started_at"].replace(":", "").replace("-", "")
    json_path = results_dir / f"bench-{stamp}.json"
    json_path.write_text(json.dumps(as_json(outcomes, meta), indent=2, default=str) + "\n")
    md_path = results_dir / "latest.md"
    md_path.write_text(markdown(outcomes, meta))
    return json_path, md_path
