"""Benchmark result rows: ratios against anchors measured in the same run, appended to
``profiling/results/<name>.md`` (a Markdown table per run) and ``<name>.jsonl`` (one JSON
object per row with the keys ``date, gpu, torch, triton, case, metric, value, anchor,
anchor_value, ratio, target, met``)."""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


def environment() -> dict[str, str]:
    """Date, GPU name, torch and triton versions of this run."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
            "triton": triton_version}


@dataclass
class ResultRow:
    """One measured value against one anchor.

    ``ratio = value / anchor_value``; ``target`` is a condition on the ratio such as
    ``"<= 1.35"`` or ``">= 3"`` (empty: reported only); ``met`` says whether it holds.
    """

    case: str
    metric: str
    value: float
    anchor: str
    anchor_value: float
    target: str = ""

    @property
    def ratio(self) -> float:
        return self.value / self.anchor_value if self.anchor_value else float("nan")

    @property
    def met(self) -> bool | None:
        if not self.target:
            return None
        op, bound = self.target.split()
        return self.ratio <= float(bound) if op == "<=" else self.ratio >= float(bound)


def _line(row: ResultRow) -> str:
    met = {None: "", True: "yes", False: "**no**"}[row.met]
    if not row.anchor_value:  # reported alone, no anchor to divide by
        return f"| {row.case} | {row.metric} | {row.value:.4g} | {row.anchor} |  |  | {row.target} | {met} |"
    return (f"| {row.case} | {row.metric} | {row.value:.4g} | {row.anchor} | "
            f"{row.anchor_value:.4g} | {row.ratio:.3f} | {row.target} | {met} |")


def format_table(rows: list[ResultRow], title: str, env: dict[str, str] | None = None) -> str:
    """The Markdown table of ``rows`` under ``title`` and this run's :func:`environment`."""
    env = environment() if env is None else env
    lines = [
        f"\n## {title}: {env['date']}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}\n",
        "| case | metric | value | anchor | anchor value | ratio | target | met |",
        "|---|---|---|---|---|---|---|---|",
        *map(_line, rows),
    ]
    return "\n".join(lines) + "\n"


def write_results(rows: list[ResultRow], results_dir: str | Path, name: str, title: str) -> str:
    """Append ``rows`` to ``results_dir/name.md`` and ``.jsonl``; returns the Markdown table."""
    env = environment()
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    with open(results_dir / f"{name}.jsonl", "a", encoding="utf-8") as jsonl:
        for row in rows:
            record = {**env, **asdict(row), "ratio": row.ratio, "met": row.met}
            jsonl.write(json.dumps(record) + "\n")
    table = format_table(rows, title, env)
    with open(results_dir / f"{name}.md", "a", encoding="utf-8") as md:
        md.write(table)
    return table
