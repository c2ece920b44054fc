"""Profiling the decode loop: traces for TensorBoard (torch-tb-profiler) and Perfetto.

:class:`StepProfiler` wraps ``torch.profiler.profile`` with a step schedule and
``tensorboard_trace_handler``; the engine labels its phases with ``record_function``
(:data:`PHASES`), so a trace shows ``prefill``, ``decode_step``, ``capture`` and, inside
decode steps, ``replay`` (CUDA-graph replays, whose kernels CUPTI records one by one).
:func:`summarize_trace` reads a written trace back: the top CPU ops and device kernels by
self time and each phase's share of the profiled steps.
"""

from __future__ import annotations

import gzip
import json
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

PHASES = ("prefill", "decode_step", "capture", "replay")
"""Phase labels the engine records; ``replay`` nests inside ``decode_step``."""
TOP_LEVEL_PHASES = ("prefill", "decode_step", "capture")


class StepProfiler:
    """``torch.profiler`` over engine steps, writing a TensorBoard/Perfetto trace.

    Args:
        trace_dir: directory for ``*.pt.trace.json`` (TensorBoard's ``--logdir``).
        active: steps to record (after ``skip_first``).
        skip_first: steps to leave out first (e.g. compilation).
        memory_snapshot: file for a CUDA memory snapshot (``torch.cuda.memory``) of the
            profiled steps, viewable at https://pytorch.org/memory_viz.
        record_shapes: record input shapes of ops.

    Use as a context manager and call :meth:`step` after every engine step.

    Raises:
        ValueError: ``memory_snapshot`` without CUDA, ``active < 1``.
    """

    def __init__(self, trace_dir: str | Path, *, active: int = 8, skip_first: int = 0,
                 memory_snapshot: str | Path | None = None, record_shapes: bool = False) -> None:
        if active < 1:
            raise ValueError(f"active must be >= 1, got {active}")
        if memory_snapshot is not None and not torch.cuda.is_available():
            raise ValueError("memory_snapshot needs CUDA; torch sees no CUDA device")
        self.trace_dir = Path(trace_dir)
        self.memory_snapshot = memory_snapshot
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        with warnings.catch_warnings():  # warmup=0 is intended: every active step counts
            warnings.filterwarnings("ignore", message=".*warmup.*")
            self._profile = profile(
                activities=activities,
                schedule=schedule(skip_first=skip_first, wait=0, warmup=0, active=active, repeat=1),
                on_trace_ready=tensorboard_trace_handler(str(self.trace_dir)),
                record_shapes=record_shapes,
            )

    def __enter__(self) -> "StepProfiler":
        if self.memory_snapshot is not None:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        if self.memory_snapshot is not None:
            torch.cuda.memory._dump_snapshot(str(self.memory_snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)

    def step(self) -> None:
        """Mark the end of one engine step."""
        self._profile.step()

    def trace_files(self) -> list[Path]:
        """The traces written so far, oldest first."""
        return sorted(self.trace_dir.glob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)


@dataclass
class TraceSummary:
    """What a trace says about its profiled steps (times in microseconds).

    Attributes:
        steps: number of ``ProfilerStep#`` spans; ``step_us`` their total duration.
        phase_us: time per top-level phase (``prefill``, ``decode_step``, ``capture``)
            inside the steps; ``other_us`` is the rest (Python between phases).
        replay_us: time in CUDA-graph replays (inside ``decode_step``).
        cpu_ops: ``(name, self time)`` of CPU ops, largest first.
        kernels: ``(name, time)`` of device kernels, largest first; ``device_busy_us``
            the union of their intervals.
        op_names: every CPU op name seen (e.g. ``compiled_attn::paged_attention``).
    """

    steps: int = 0
    step_us: float = 0.0
    phase_us: dict[str, float] = field(default_factory=dict)
    other_us: float = 0.0
    replay_us: float = 0.0
    cpu_ops: list[tuple[str, float]] = field(default_factory=list)
    kernels: list[tuple[str, float]] = field(default_factory=list)
    device_busy_us: float = 0.0
    op_names: set[str] = field(default_factory=set)

    def shares(self) -> dict[str, float]:
        """Fraction of the profiled steps' time per top-level phase and ``other``; sums to 1."""
        if not self.step_us:
            return {}
        out = {name: us / self.step_us for name, us in self.phase_us.items()}
        out["other"] = self.other_us / self.step_us
        return out

    def format(self, top: int = 10) -> str:
        """A short text report."""
        lines = [f"{self.steps} profiled steps, {self.step_us / 1e3:.2f} ms in all"]
        lines += [f"  {name:<12} {share:6.1%}" for name, share in self.shares().items()]
        if self.replay_us:
            lines.append(f"  (CUDA-graph replay: {self.replay_us / 1e3:.2f} ms)")
        if self.kernels:
            lines.append(f"device busy {self.device_busy_us / max(self.step_us, 1e-9):.1%} of step time")
        for title, rows in (("top CPU ops by self time", self.cpu_ops), ("top kernels by time", self.kernels)):
            if rows:
                lines.append(title + ":")
                lines += [f"  {us / 1e3:9.3f} ms  {name[:90]}" for name, us in rows[:top]]
        return "\n".join(lines)


def load_trace(path: str | Path) -> list[dict]:
    """The complete (``ph == "X"``) events of a Chrome-format trace (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _cpu_self_times(events: list[dict]) -> dict[str, float]:
    """Self time of CPU ops: duration minus that of ops nested directly inside, per thread."""
    self_us: dict[str, float] = defaultdict(float)
    by_thread = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for ops in by_thread.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, self]
        for e in ops:
            while stack and stack[-1][0] <= e["ts"]:
                _, name, own = stack.pop()
                self_us[name] += own
            if stack:
                stack[-1][2] -= e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], e["dur"]])
        for _, name, own in stack:
            self_us[name] += own
    return self_us


def summarize_trace(path: str | Path) -> TraceSummary:
    """Summarize one trace written by :class:`StepProfiler`."""
    events = load_trace(path)
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in steps]

    def inside(e) -> bool:
        return any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in spans)

    summary = TraceSummary(steps=len(steps), step_us=sum(b - a for a, b in spans))
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"] in PHASES and inside(e):
            if e["name"] == "replay":
                summary.replay_us += e["dur"]
            else:
                summary.phase_us[e["name"]] = summary.phase_us.get(e["name"], 0.0) + e["dur"]
    summary.other_us = summary.step_us - sum(summary.phase_us.values())
    cpu = _cpu_self_times(events)
    summary.cpu_ops = sorted(cpu.items(), key=lambda kv: -kv[1])
    summary.op_names = set(cpu)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    per_kernel: dict[str, float] = defaultdict(float)
    for e in kernels:
        per_kernel[e["name"]] += e["dur"]
    summary.kernels = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    summary.device_busy_us = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    return summary
