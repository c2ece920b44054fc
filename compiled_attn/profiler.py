"""Profiling the decode loop: traces for TensorBoard (torch-tb-profiler), Perfetto and HTA.

:class:`StepProfiler` wraps ``torch.profiler.profile`` with a step schedule and
``tensorboard_trace_handler``; the engine labels its phases with ``record_function``
(:data:`PHASES`), so a trace shows ``prefill``, ``decode_step``, ``capture`` and, inside
decode steps, ``replay`` (CUDA-graph replays, whose kernels CUPTI records one by one).

Steps are accounted per phase: once a trace is written, :func:`label_trace_steps` renames
the profiler's step spans by what they hold, so ``ProfilerStep#N`` marks decode steps only
and a prefill step reads ``PrefillStep#N`` (a step that captures CUDA graphs
``CaptureStep#N``, an empty one ``IdleStep#N``). TensorBoard's "average step time" and
HTA's per-step views then compare decode steps with decode steps. The worker is named
``compiled-attn-<device>-rank<r>`` (:func:`worker_name`) and the trace carries
``distributedInfo`` (rank, world size), which HTA needs to read it. With ``with_stack``,
:func:`add_call_stacks` gives each CPU op the ``Call stack`` argument TensorBoard's "View
CallStack" reads.

:func:`summarize_trace` reads a written trace back: the top CPU ops and device kernels by
self time, each phase's share of the profiled steps and step statistics per kind
(:meth:`TraceSummary.step_stats`). :mod:`compiled_attn.profile_report` renders it as one
offline HTML file.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import statistics
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from .ops.arith import cdiv

PHASES = ("prefill", "decode_step", "capture", "replay")
"""Phase labels the engine records; ``replay`` nests inside ``decode_step``."""
TOP_LEVEL_PHASES = ("prefill", "decode_step", "capture")
STEP_NAMES = {"decode": "ProfilerStep", "prefill": "PrefillStep", "capture": "CaptureStep", "idle": "IdleStep"}
"""Span name per step kind in a labelled trace; only decode steps keep the profiler's name."""
_STEP_RE = re.compile(r"^(%s)#(\d+)$" % "|".join(STEP_NAMES.values()))
TRACE_SUFFIXES = (".pt.trace.json.gz", ".pt.trace.json")
"""Endings of complete trace files, longest first (torch writes ``<name>.tmp`` first, then
renames it)."""


def _rank_and_world_size() -> tuple[int, int]:
    """This process's rank and world size: ``torch.distributed`` when initialized, else
    torchrun's ``RANK`` / ``WORLD_SIZE`` environment, else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str, a torch.device or None, got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"device: {device!r} is not a torch device ({err})") from None


def worker_name(device: str | torch.device | None = None, rank: int | None = None) -> str:
    """The trace's worker name, ``compiled-attn-<device>-rank<r>`` (e.g.
    ``compiled-attn-cuda0-rank0``; ``cuda`` without an index names the current device).

    Args:
        device: the device the engine runs on (default: CUDA when available, else CPU).
        rank: the process's rank (default: ``torch.distributed`` or ``RANK``, else 0).

    Raises:
        TypeError: ``device`` is not a str, ``torch.device`` or None; ``rank`` not an int.
        ValueError: ``device`` names no torch device; ``rank < 0``.
    """
    dev = _device(device)
    if rank is None:
        rank = _rank_and_world_size()[0]
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"rank must be an int or None, got {type(rank).__name__}")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    index = dev.index
    if dev.type == "cuda" and index is None and torch.cuda.is_available():
        index = torch.cuda.current_device()
    return f"compiled-attn-{dev.type}{'' if index is None else index}-rank{rank}"


class StepProfiler:
    """``torch.profiler`` over engine steps, writing a TensorBoard/Perfetto/HTA trace.

    Args:
        trace_dir: directory for ``<worker>.<ns>.pt.trace.json`` (TensorBoard's ``--logdir``,
            HTA's ``trace_dir``).
        active: steps to record (after ``skip_first``).
        skip_first: steps to leave out first (e.g. compilation).
        memory_snapshot: file for a CUDA memory snapshot (``torch.cuda.memory``) of the
            profiled steps, viewable at https://pytorch.org/memory_viz.
        record_shapes: record ops' input shapes (TensorBoard's "Group by input shape").
        with_stack: record Python stacks (``python_function`` spans around each op, and
            each op's ``Call stack`` argument for TensorBoard's "View CallStack";
            :func:`add_call_stacks`).
        profile_memory: record tensor allocations and frees (``[memory]`` events).
        device: the device the engine runs on, for the worker name and the trace metadata
            (default: CUDA when available, else CPU).

    Use as a context manager and call :meth:`step` after every engine step. Each written
    trace gets its steps labelled per phase (:func:`label_trace_steps`) and the metadata
    ``distributedInfo`` (``rank``, ``world_size``; torch writes its own when
    ``torch.distributed`` is initialized) and ``compiled_attn`` (device, worker, torch version).

    Raises:
        ValueError: ``memory_snapshot`` without CUDA, ``active < 1``, ``skip_first < 0``,
            a bad ``device``.
        TypeError: ``device`` of another type.
    """

    def __init__(self, trace_dir: str | Path, *, active: int = 8, skip_first: int = 0,
                 memory_snapshot: str | Path | None = None, record_shapes: bool = False,
                 with_stack: bool = False, profile_memory: bool = False,
                 device: str | torch.device | None = None) -> None:
        if active < 1:
            raise ValueError(f"active must be >= 1, got {active}")
        if skip_first < 0:
            raise ValueError(f"skip_first must be >= 0, got {skip_first}")
        if memory_snapshot is not None and not torch.cuda.is_available():
            raise ValueError("memory_snapshot needs CUDA; torch sees no CUDA device")
        dev = _device(device)
        rank, world_size = _rank_and_world_size()
        self.worker = worker_name(dev, rank)
        self.trace_dir = Path(trace_dir)
        self.memory_snapshot = memory_snapshot
        self.with_stack = with_stack
        self.written: list[Path] = []
        self._handler = tensorboard_trace_handler(str(self.trace_dir), worker_name=self.worker)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        with warnings.catch_warnings():  # warmup=0 is intended: every active step counts
            warnings.filterwarnings("ignore", message=".*warmup.*")
            self._profile = profile(
                activities=activities,
                schedule=schedule(skip_first=skip_first, wait=0, warmup=0, active=active, repeat=1),
                on_trace_ready=self._trace_ready,
                record_shapes=record_shapes,
                with_stack=with_stack,
                profile_memory=profile_memory,
            )
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):  # else torch writes its own
            info = {"rank": rank, "world_size": world_size}
            self._profile.preset_metadata_json("distributedInfo", json.dumps(info))
        meta = {"device": str(dev), "worker": self.worker, "torch": torch.__version__}
        if dev.type == "cuda" and torch.cuda.is_available():
            meta["device_name"] = torch.cuda.get_device_name(dev)
        self._profile.preset_metadata_json("compiled_attn", json.dumps(meta))

    def _trace_ready(self, prof) -> None:
        # Only this worker's complete files: another rank writes into the same directory.
        before = set(list_traces(self.trace_dir, self.worker))
        self._handler(prof)
        for path in sorted(set(list_traces(self.trace_dir, self.worker)) - before):
            label_trace_steps(path)
            if self.with_stack:
                add_call_stacks(path)
            self.written.append(path)

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
        """The complete traces in ``trace_dir`` (this profiler's, older ones and other
        workers'), oldest first; :attr:`written` holds only this profiler's."""
        return list_traces(self.trace_dir)


def list_traces(directory: str | Path, worker: str = "*") -> list[Path]:
    """The complete traces ``<worker>.*.pt.trace.json[.gz]`` in ``directory``, oldest
    (by modification time) first; half-written ``.tmp`` files are left out.

    Args:
        directory: a trace directory (none there: an empty list).
        worker: a worker name (:func:`worker_name`), or ``*`` for every worker.
    """
    paths = [p for p in Path(directory).glob(f"{worker}.*") if p.name.endswith(TRACE_SUFFIXES)]
    return sorted(paths, key=lambda p: p.stat().st_mtime)


def _open(path: Path, mode: str):
    return (gzip.open if path.suffix == ".gz" else open)(path, mode, encoding="utf-8")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_trace(path: str | Path) -> dict:
    """A Chrome-format trace (``.json`` or ``.json.gz``) as a dict with ``traceEvents``,
    the events that are JSON objects (others are dropped).

    Raises:
        ValueError: the file is not a JSON trace, a complete (``ph == "X"``) event has a
            ``ts`` or ``dur`` that is not a finite number or a ``name`` that is not a string
            (names the event's index), or no complete event is left; each names ``path``.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    try:
        with _open(path, "rt") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, gzip.BadGzipFile, EOFError) as err:
        raise ValueError(f"path {path}: not a JSON trace ({err})") from None
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"path {path}: not a Chrome trace (no traceEvents list)")
    for i, e in enumerate(data["traceEvents"]):
        if isinstance(e, dict) and e.get("ph") == "X" and not (
                _is_number(e.get("ts")) and _is_number(e.get("dur")) and isinstance(e.get("name"), str)):
            raise ValueError(f"path {path}: traceEvents[{i}] (ph 'X') needs a number ts and dur and a string "
                             f"name, got ts={e.get('ts')!r}, dur={e.get('dur')!r}, name={e.get('name')!r}")
    data["traceEvents"] = [e for e in data["traceEvents"] if isinstance(e, dict)]
    if not any(e.get("ph") == "X" for e in data["traceEvents"]):
        raise ValueError(f"path {path}: holds no complete (ph 'X') events")
    return data


def _complete(data: dict) -> list[dict]:
    return [e for e in data["traceEvents"] if e.get("ph") == "X"]


def load_trace(path: str | Path) -> list[dict]:
    """The complete (``ph == "X"``) events of a Chrome-format trace (``.json`` or ``.json.gz``).

    Raises:
        ValueError, FileNotFoundError: as :func:`read_trace`.
    """
    return _complete(read_trace(path))


def add_call_stacks(path: str | Path) -> int:
    """Give each CPU op of a trace recorded ``with_stack`` its Python stack as
    ``args["Call stack"]``, in place: the names of the ``python_function`` spans around it on
    its thread, innermost first, joined by ``;`` (``file.py(123): func;...``), the argument
    torch-tb-profiler reads for "View CallStack" (torch 2.13 writes only the spans). Ops without
    an enclosing span get none. Running it again changes nothing.

    Returns:
        The number of ops given a stack.

    Raises:
        ValueError, FileNotFoundError: as :func:`read_trace`.
    """
    path = Path(path)
    data = read_trace(path)
    threads = defaultdict(list)
    for e in _complete(data):
        if e.get("cat") in ("python_function", "cpu_op"):
            threads[(e.get("pid"), e.get("tid"))].append(e)
    stacked = 0
    for events in threads.values():
        # Spans before the ops they start with; each span encloses those after it until it ends.
        events.sort(key=lambda e: (e["ts"], -e["dur"], e["cat"] != "python_function"))
        stack: list[tuple[float, str]] = []  # (end, name) of the open spans, outermost first
        for e in events:
            while stack and stack[-1][0] <= e["ts"]:
                stack.pop()
            if e["cat"] == "python_function":
                stack.append((e["ts"] + e["dur"], e["name"]))
            elif stack:
                e.setdefault("args", {})["Call stack"] = ";".join(name for _, name in reversed(stack))
                stacked += 1
    with _open(path, "wt") as f:
        json.dump(data, f)
    return stacked


def _is_step(e: dict) -> bool:
    return e.get("cat") == "user_annotation" and _STEP_RE.match(e.get("name", "")) is not None


def classify_steps(events: list[dict]) -> list[tuple[dict, str]]:
    """Each step span of a trace (``ProfilerStep#N`` or an already labelled name) with its
    kind, in time order: ``prefill`` if a ``prefill`` phase starts inside it, else
    ``capture`` if a ``capture`` does, else ``decode`` if a ``decode_step`` does, else ``idle``
    (e.g. the empty step the profiler opens after the engine's last step).

    Args:
        events: complete events of a trace (:func:`load_trace`).
    """
    steps = sorted((e for e in events if _is_step(e)), key=lambda e: e["ts"])
    phases = sorted(((e["ts"], e["name"]) for e in events
                     if e.get("cat") == "user_annotation" and e["name"] in TOP_LEVEL_PHASES))
    out = []
    for step in steps:
        start, end = step["ts"], step["ts"] + step["dur"]
        inside = {name for ts, name in phases if start <= ts < end}
        kind = ("prefill" if "prefill" in inside else "capture" if "capture" in inside
                else "decode" if "decode_step" in inside else "idle")
        out.append((step, kind))
    return out


def label_trace_steps(path: str | Path) -> dict[str, int]:
    """Rename a written trace's step spans by kind (:data:`STEP_NAMES`), in place.

    ``ProfilerStep#N`` stays on decode steps only, so TensorBoard's step statistics and
    HTA's iterations cover decode steps; prefill steps become ``PrefillStep#N`` and so on
    (same ``N``). Running it again changes nothing.

    Returns:
        Steps per kind, e.g. ``{"prefill": 1, "decode": 7}``.

    Raises:
        ValueError, FileNotFoundError: as :func:`read_trace`.
    """
    path = Path(path)
    events = load_trace(path)
    counts: dict[str, int] = defaultdict(int)
    renames = {}
    for step, kind in classify_steps(events):
        counts[kind] += 1
        number = _STEP_RE.match(step["name"]).group(2)
        wanted = f"{STEP_NAMES[kind]}#{number}"
        if step["name"] != wanted:
            renames[json.dumps(step["name"])] = json.dumps(wanted)
    if renames:
        with _open(path, "rt") as f:
            text = f.read()
        # Names are whole JSON strings (quotes included): "ProfilerStep#1" never matches #10.
        text = re.sub("|".join(re.escape(k) for k in renames), lambda m: renames[m.group(0)], text)
        with _open(path, "wt") as f:
            f.write(text)
    return dict(counts)


@dataclass
class StepStats:
    """Durations of one kind of step (microseconds); zeros when ``count == 0``."""

    count: int = 0
    total_us: float = 0.0
    mean_us: float = 0.0
    median_us: float = 0.0
    p90_us: float = 0.0
    min_us: float = 0.0
    max_us: float = 0.0

    @classmethod
    def of(cls, durations: list[float]) -> "StepStats":
        """Statistics of ``durations`` (microseconds); p90 by the nearest-rank method."""
        if not durations:
            return cls()
        ordered = sorted(durations)
        p90 = ordered[max(0, cdiv(9 * len(ordered), 10) - 1)]
        return cls(len(ordered), sum(ordered), statistics.fmean(ordered), statistics.median(ordered),
                   p90, ordered[0], ordered[-1])

    def as_dict(self) -> dict | None:
        """JSON-ready dict of the fields; None when ``count == 0`` (no such step profiled)."""
        return asdict(self) if self.count else None


@dataclass
class TraceSummary:
    """What a trace says about its profiled steps (times in microseconds).

    Attributes:
        steps: number of step spans (every kind); ``step_us`` their total duration.
        step_us_by_kind: each step's duration, per kind (``decode``, ``prefill``,
            ``capture``, ``idle``; see :func:`classify_steps`), in time order.
        phase_us: time per top-level phase (``prefill``, ``decode_step``, ``capture``)
            inside the steps; ``other_us`` is the rest (Python between phases).
        replay_us: time in CUDA-graph replays (inside ``decode_step``).
        cpu_ops: ``(name, self time)`` of CPU ops, largest first.
        kernels: ``(name, time)`` of device kernels, largest first; ``device_busy_us``
            the union of their intervals.
        op_names: every CPU op name seen (e.g. ``compiled_attn::paged_attention``).
        op_shapes: ``(name, input dims, calls, total time)`` of our ``compiled_attn::``
            ops per input shape, largest time first (empty unless shapes were recorded).
        memory_peak_bytes: most bytes allocated at once per device (``"cpu"``,
            ``"cuda:0"``), from ``[memory]`` events (empty unless memory was profiled).
        metadata: the trace's top-level entries other than events (``distributedInfo``,
            ``deviceProperties``, ``compiled_attn``, ``record_shapes`` ...).
    """

    steps: int = 0
    step_us: float = 0.0
    step_us_by_kind: dict[str, list[float]] = field(default_factory=dict)
    phase_us: dict[str, float] = field(default_factory=dict)
    other_us: float = 0.0
    replay_us: float = 0.0
    cpu_ops: list[tuple[str, float]] = field(default_factory=list)
    kernels: list[tuple[str, float]] = field(default_factory=list)
    device_busy_us: float = 0.0
    op_names: set[str] = field(default_factory=set)
    op_shapes: list[tuple[str, str, int, float]] = field(default_factory=list)
    memory_peak_bytes: dict[str, int] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    def shares(self) -> dict[str, float]:
        """Fraction of the profiled steps' time per top-level phase and ``other``; sums to 1."""
        if not self.step_us:
            return {}
        out = {name: us / self.step_us for name, us in self.phase_us.items()}
        out["other"] = self.other_us / self.step_us
        return out

    def step_stats(self, kind: str = "decode") -> StepStats:
        """Statistics of the steps of one kind; ``decode`` excludes prefill, capture and
        idle steps, so its mean compares like with like.

        Raises:
            ValueError: ``kind`` is not one of :data:`STEP_NAMES`.
        """
        if kind not in STEP_NAMES:
            raise ValueError(f"kind must be one of {tuple(STEP_NAMES)}, got {kind!r}")
        return StepStats.of(self.step_us_by_kind.get(kind, []))

    def format(self, top: int = 10) -> str:
        """A short text report."""
        lines = [f"{self.steps} profiled steps, {self.step_us / 1e3:.2f} ms in all"]
        lines += [f"  {name:<12} {share:6.1%}" for name, share in self.shares().items()]
        if self.replay_us:
            lines.append(f"  (CUDA-graph replay: {self.replay_us / 1e3:.2f} ms)")
        for kind in STEP_NAMES:
            s = self.step_stats(kind)
            if s.count == 1 and kind != "idle":
                lines.append(f"{kind} steps: 1, {s.total_us / 1e3:.3f} ms")
            elif s.count and kind != "idle":
                lines.append(f"{kind} steps: {s.count}, mean {s.mean_us / 1e3:.3f} ms, median "
                             f"{s.median_us / 1e3:.3f} ms, p90 {s.p90_us / 1e3:.3f} ms, "
                             f"min {s.min_us / 1e3:.3f} ms, max {s.max_us / 1e3:.3f} ms")
        if self.kernels:
            lines.append(f"device busy {self.device_busy_us / max(self.step_us, 1e-9):.1%} of step time")
        for title, rows in (("top CPU ops by self time", self.cpu_ops), ("top kernels by time", self.kernels)):
            if rows:
                lines.append(title + ":")
                lines += [f"  {us / 1e3:9.3f} ms  {name[:90]}" for name, us in rows[:top]]
        return "\n".join(lines)


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


def _memory_peaks(events: list[dict]) -> dict[str, int]:
    peaks: dict[str, int] = {}
    for e in events:
        if e.get("name") == "[memory]" and isinstance(e.get("args"), dict):
            args = e["args"]
            device = "cpu" if args.get("Device Type", 0) == 0 else f"cuda:{args.get('Device Id', 0)}"
            peaks[device] = max(peaks.get(device, 0), int(args.get("Total Allocated", 0)))
    return peaks


def summarize_trace(path: str | Path) -> TraceSummary:
    """Summarize one trace written by :class:`StepProfiler` (labelled or not).

    Raises:
        ValueError, FileNotFoundError: as :func:`read_trace`.
    """
    data = read_trace(path)
    events = _complete(data)
    kinds = classify_steps(events)
    spans = [(e["ts"], e["ts"] + e["dur"]) for e, _ in kinds]

    def inside(e) -> bool:
        return any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in spans)

    summary = TraceSummary(steps=len(kinds), step_us=sum(b - a for a, b in spans),
                           metadata={k: v for k, v in data.items() if k != "traceEvents"})
    for step, kind in kinds:
        summary.step_us_by_kind.setdefault(kind, []).append(step["dur"])
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
    shapes: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        dims = (e.get("args") or {}).get("Input Dims")
        if e.get("cat") == "cpu_op" and e["name"].startswith("compiled_attn::") and dims is not None:
            row = shapes[(e["name"], json.dumps([d for d in dims if d], separators=(",", ":")))]
            row[0] += 1
            row[1] += e["dur"]
    summary.op_shapes = sorted(((n, d, c, us) for (n, d), (c, us) in shapes.items()), key=lambda r: -r[3])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    per_kernel: dict[str, float] = defaultdict(float)
    for e in kernels:
        per_kernel[e["name"]] += e["dur"]
    summary.kernels = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    summary.device_busy_us = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    summary.memory_peak_bytes = _memory_peaks(data["traceEvents"])
    return summary
