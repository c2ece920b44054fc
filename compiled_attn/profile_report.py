"""One self-contained HTML report of a profiler trace, readable on any machine.

``compiled-attn profile-report DIR`` renders the newest trace of the lowest rank in ``DIR``
(:func:`find_trace`; or one trace file) with :func:`write_report`: step statistics per kind
(decode steps apart from prefill), each phase's share of the profiled steps, the device-busy
share, the top CPU ops and device kernels, our ops per input shape (when shapes were
recorded) and a timeline picture of the last few steps (:func:`timeline_svg`). Styles and the picture are inline:
the file references nothing on the network, unlike TensorBoard's profiler plugin (which
loads Google Charts) or Perfetto's web UI.
"""

from __future__ import annotations

import html
import math
import re
from pathlib import Path

from .profiler import (STEP_NAMES, TRACE_SUFFIXES, TraceSummary, classify_steps, list_traces, load_trace,
                       summarize_trace)

_TRACE_SUFFIXES = (*TRACE_SUFFIXES, ".json.gz", ".json")  # stripped from a report's name, longest first
COLORS = {"attention": "#d62728", "reshape_and_cache": "#2ca02c", "merge": "#ff7f0e", "other": "#1f77b4"}
"""Timeline colors of ops and kernels: the first key found in an event's name, else ``other``."""
_SPAN_COLORS = {"prefill": "#9467bd", "decode_step": "#17becf", "capture": "#8c564b", "replay": "#bcbd22",
                "decode": "#7f7f7f", "idle": "#dddddd"}
_RANK_RE = re.compile(r"-rank(\d+)\.\d+\.pt\.trace\.json(\.gz)?$")


def _rank(trace: Path) -> int:
    match = _RANK_RE.search(trace.name)
    return int(match.group(1)) if match else 0


def find_trace(path: str | Path) -> Path:
    """The trace to report: ``path`` itself if it is a file, else, of the complete traces
    ``*.pt.trace.json[.gz]`` in the directory ``path`` (half-written ``.tmp`` files are
    ignored), the newest of the lowest rank. The rank is read from the name
    (``compiled-attn-<device>-rank<r>.<ns>.pt.trace.json``; a name without one counts as
    rank 0), so with several ranks or runs in one directory rank 0's last run is chosen;
    :func:`write_report` lists the traces left out in the report.

    Raises:
        ValueError: ``path`` does not exist, or is a directory without a trace.
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"path {path}: no such file or directory")
    traces = list_traces(path)
    if not traces:
        raise ValueError(f"path {path}: holds no *.pt.trace.json trace (write one with generate --profile {path})")
    lowest = min(map(_rank, traces))
    return [p for p in traces if _rank(p) == lowest][-1]


def _color(name: str) -> str:
    return next((c for key, c in COLORS.items() if key in name), COLORS["other"])


def _top_level_ops(events: list[dict]) -> list[dict]:
    """CPU ops not nested in another CPU op of their thread."""
    out, ends = [], {}
    for e in sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["ts"], -e["dur"])):
        thread = (e.get("pid"), e.get("tid"))
        if e["ts"] >= ends.get(thread, float("-inf")):
            out.append(e)
            ends[thread] = e["ts"] + e["dur"]
    return out


def _nice_tick(span: float) -> float:
    raw = span / 6 if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def timeline_lanes(events: list[dict], steps: int = 3) -> tuple[float, float, list[tuple[str, list[tuple[dict, str]]]]]:
    """What the timeline picture draws: the window of the last ``steps`` non-idle profiled
    steps and, per lane, the events overlapping it with their colors (hex strings).

    Lanes: ``steps`` (colored by kind), ``phases`` (``prefill``, ``decode_step``,
    ``capture``), ``graph replays``, ``our ops (host)`` (``compiled_attn::`` ops, colored
    by :data:`COLORS`), ``other host ops`` (top-level CPU ops) and ``kernels (device)``;
    lanes without events are left out, but for ``steps`` and ``phases``.

    Args:
        events: complete events of a trace (:func:`compiled_attn.profiler.load_trace`).
        steps: how many steps to show (the whole trace when it has no step spans).

    Returns:
        ``(start_us, end_us, [(lane, [(event, color), ...]), ...])``, events in time order.

    Raises:
        ValueError: ``steps < 1``; ``events`` holds no timed event.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    timed = [e for e in events if "ts" in e and "dur" in e]
    if not timed:
        raise ValueError("events holds no timed (ph == 'X') event to draw")
    kinds = [(e, k) for e, k in classify_steps(timed) if k != "idle"][-steps:]
    if kinds:
        start, end = kinds[0][0]["ts"], max(e["ts"] + e["dur"] for e, _ in kinds)
    else:
        start, end = min(e["ts"] for e in timed), max(e["ts"] + e["dur"] for e in timed)
    lanes = [
        ("steps", [(e, _SPAN_COLORS[k]) for e, k in kinds]),
        ("phases", [(e, _SPAN_COLORS[e["name"]]) for e in timed
                    if e.get("cat") == "user_annotation" and e["name"] in ("prefill", "decode_step", "capture")]),
        ("graph replays", [(e, _SPAN_COLORS["replay"]) for e in timed
                           if e.get("cat") == "user_annotation" and e["name"] == "replay"]),
        ("our ops (host)", [(e, _color(e["name"])) for e in timed
                            if e.get("cat") == "cpu_op" and e["name"].startswith("compiled_attn::")]),
        ("other host ops", [(e, "#aec7e8") for e in _top_level_ops(timed)
                            if not e["name"].startswith("compiled_attn::")]),
        ("kernels (device)", [(e, _color(e["name"])) for e in timed if e.get("cat") == "kernel"]),
    ]
    shown = []
    for lane, lane_events in lanes:
        inside = [(e, c) for e, c in lane_events if e["ts"] < end and e["ts"] + e["dur"] > start]
        if inside or lane in ("steps", "phases"):
            shown.append((lane, sorted(inside, key=lambda ec: ec[0]["ts"])))
    return start, end, shown


def timeline_svg(events: list[dict], steps: int = 3, width: int = 960) -> str:
    """An inline ``<svg>`` of :func:`timeline_lanes`: one row per lane, an axis in ms.
    Bars carry ``<title>`` tooltips; sub-pixel bars of one color are merged. No ``xmlns``
    attribute: it is meant for inline use in HTML, which needs none (and so holds no URL);
    add ``xmlns="http://www.w3.org/2000/svg"`` for a standalone ``.svg`` file.

    Args:
        events: complete events of a trace (:func:`compiled_attn.profiler.load_trace`).
        steps: how many steps to draw (the whole trace when it has no step spans).
        width: picture width in pixels.

    Raises:
        ValueError: ``steps < 1`` or ``width < 200``; ``events`` holds no timed event.
    """
    if width < 200:
        raise ValueError(f"width must be >= 200, got {width}")
    start, end, shown = timeline_lanes(events, steps)
    span = max(end - start, 1e-3)
    label_w, row_h, top = 130, 26, 8
    plot_w = width - label_w - 10
    height = top + row_h * len(shown) + 34
    out = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'font-family="sans-serif" font-size="12"><rect width="{width}" height="{height}" fill="#fff"/>']
    for row, (lane, lane_events) in enumerate(shown):
        y = top + row * row_h
        out.append(f'<text x="{label_w - 6}" y="{y + row_h / 2 + 4}" text-anchor="end">{html.escape(lane)}</text>')
        out.append(f'<rect x="{label_w}" y="{y + 2}" width="{plot_w}" height="{row_h - 4}" fill="#f4f4f4"/>')
        merged: list[list] = []  # [x0, x1, color, names, count]
        for e, color in lane_events:
            x0 = label_w + max(e["ts"] - start, 0) / span * plot_w
            x1 = label_w + min(e["ts"] + e["dur"] - start, span) / span * plot_w
            x1 = max(x1, x0 + 0.5)
            if merged and merged[-1][2] == color and x0 - merged[-1][1] < 0.5 and x1 - merged[-1][0] < 2:
                merged[-1][1] = max(merged[-1][1], x1)
                merged[-1][4] += 1
                continue
            merged.append([x0, x1, color, f'{e["name"]} ({e["dur"] / 1e3:.3f} ms)', 1])
        for x0, x1, color, title, count in merged:
            tip = title if count == 1 else f"{count} events"
            out.append(f'<rect x="{x0:.2f}" y="{y + 4}" width="{x1 - x0:.2f}" height="{row_h - 8}" '
                       f'fill="{color}"><title>{html.escape(tip[:300])}</title></rect>')
    axis_y = top + row_h * len(shown) + 4
    out.append(f'<line x1="{label_w}" y1="{axis_y}" x2="{label_w + plot_w}" y2="{axis_y}" stroke="#333"/>')
    tick = _nice_tick(span / 1e3)
    for i in range(int(span / 1e3 / tick) + 1):
        x = label_w + i * tick * 1e3 / span * plot_w
        out.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#333"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle">{i * tick:g}</text>')
    out.append(f'<text x="{label_w - 6}" y="{axis_y + 16}" text-anchor="end">ms</text></svg>')
    return "".join(out)


_STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: .5em 0; font-size: .9em; }
th, td { padding: 3px 10px; border-bottom: 1px solid #e4e4e4; text-align: right; }
th { background: #f0f0f0; } td.name, th.name { text-align: left; font-family: monospace; max-width: 600px;
  overflow-wrap: anywhere; }
.bar { display: inline-block; height: .8em; background: #1f77b4; vertical-align: middle; }
.meta { color: #555; font-size: .9em; } .swatch { display: inline-block; width: .9em; height: .9em;
  vertical-align: middle; margin: 0 .3em 0 1em; }
"""


def _ms(us: float) -> str:
    return f"{us / 1e3:.3f}"


def _table(headers: list[str], rows: list[list], name_cols: tuple[int, ...] = (1,)) -> str:
    def cell(tag, i, value):
        cls = ' class="name"' if i in name_cols else ""
        return f"<{tag}{cls}>{value}</{tag}>"

    head = "".join(cell("th", i, html.escape(h)) for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_report(trace: str | Path, *, top: int = 15, steps: int = 3,
                  left_out: list[Path] | None = None) -> str:
    """The HTML text of the report of one trace (see the module docstring).

    Args:
        trace: a trace file (``*.pt.trace.json`` or ``.json.gz``).
        top: rows in the ops and kernels tables.
        steps: steps drawn in the timeline.
        left_out: the other traces of ``trace``'s directory, named in the report's first lines.

    Raises:
        ValueError: ``top < 1``, ``steps < 1``, ``trace`` is not a JSON trace (see
            :func:`compiled_attn.profiler.read_trace`).
        FileNotFoundError: no such file.
    """
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    trace = Path(trace)
    events = load_trace(trace)
    s: TraceSummary = summarize_trace(trace)
    meta = s.metadata
    ours = meta.get("compiled_attn") if isinstance(meta.get("compiled_attn"), dict) else {}
    dist = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
    recorded = [k.replace("_", " ") for k in ("record_shapes", "with_stack", "profile_memory") if meta.get(k)]
    facts = [f"trace <code>{html.escape(trace.name)}</code>"]
    if left_out:
        names = ", ".join(f"<code>{html.escape(p.name)}</code>" for p in left_out)
        facts.append(f"the newest of the lowest rank in its directory; left out: {names}")
    if ours.get("worker"):
        facts.append(f"worker {html.escape(str(ours['worker']))}")
    if "rank" in dist:
        facts.append(f"rank {html.escape(str(dist['rank']))} of {html.escape(str(dist.get('world_size', '?')))}")
    for key in ("device", "device_name", "torch"):
        if ours.get(key):
            facts.append(f"{key.replace('_', ' ')} {html.escape(str(ours[key]))}")
    facts.append("recorded: " + (", ".join(recorded) if recorded else "ops and phases only (no shapes, stacks or memory)"))

    parts = [f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
             f"<title>compiled-attn profile: {html.escape(trace.name)}</title><style>{_STYLE}</style></head><body>",
             "<h1>compiled-attn profile report</h1>", f'<p class="meta">{" · ".join(facts)}</p>']

    parts.append("<h2>Steps</h2>")
    span_names: dict[str, set[str]] = {}
    for step, kind in classify_steps(events):  # labelled by StepProfiler, or ProfilerStep# throughout
        span_names.setdefault(kind, set()).add(step["name"].split("#")[0])
    rows = []
    for kind in STEP_NAMES:
        st = s.step_stats(kind)
        if st.count:
            names = ", ".join(f"<code>{html.escape(n)}#N</code>" for n in sorted(span_names.get(kind, ())))
            rows.append([html.escape(kind), names, st.count, _ms(st.total_us),
                         _ms(st.mean_us), _ms(st.median_us), _ms(st.p90_us), _ms(st.min_us), _ms(st.max_us)])
    if rows:
        parts.append(_table(["kind", "span name", "steps", "total ms", "mean ms", "median ms", "p90 ms",
                             "min ms", "max ms"], rows, name_cols=(0, 1)))
        parts.append('<p class="meta">Each profiled engine step is one kind: <b>prefill</b> if it prefills '
                     "(a decode read may precede it), <b>capture</b> if it captures CUDA graphs, <b>decode</b> "
                     "if it launches or reads a decode step, <b>idle</b> otherwise (the profiler's step after "
                     "the last engine step). Decode statistics leave prefill, capture and idle steps out.</p>")
    else:
        parts.append("<p>No profiler step spans in this trace.</p>")

    parts.append("<h2>Phase shares of the profiled steps</h2>")
    shares = s.shares()
    if shares:
        rows = [[html.escape(name), f"{share:.1%}", f'<span class="bar" style="width:{max(share, 0) * 300:.0f}px"></span>']
                for name, share in shares.items()]
        parts.append(_table(["phase", "share", ""], rows, name_cols=(0, 2)))
        if s.replay_us:
            parts.append(f"<p>CUDA-graph replays: {_ms(s.replay_us)} ms inside decode steps.</p>")
    if s.kernels:
        busy = s.device_busy_us / max(s.step_us, 1e-9)
        parts.append(f"<p><b>Device busy {busy:.1%}</b> of the profiled steps' time "
                     f"({_ms(s.device_busy_us)} of {_ms(s.step_us)} ms, union of kernel intervals).</p>")

    parts.append("<h2>Timeline</h2>")
    parts.append(timeline_svg(events, steps=steps))
    legend = "".join(f'<span class="swatch" style="background:{c}"></span>{html.escape(k)}' for k, c in COLORS.items())
    spans = "".join(f'<span class="swatch" style="background:{c}"></span>{html.escape(k)}'
                    for k, c in _SPAN_COLORS.items() if k != "idle")
    parts.append(f'<p class="meta">Ops and kernels: {legend}<br>Steps and phases: {spans}</p>')

    cpu_total = sum(us for _, us in s.cpu_ops) or 1.0
    parts.append(f"<h2>Top {top} host ops by self time</h2>")
    rows = [[i + 1, html.escape(name), _ms(us), f"{us / cpu_total:.1%}"] for i, (name, us) in enumerate(s.cpu_ops[:top])]
    parts.append(_table(["#", "op", "self ms", "share"], rows) if rows else "<p>No host ops recorded.</p>")

    parts.append(f"<h2>Top {top} device kernels by time</h2>")
    if s.kernels:
        kernel_total = sum(us for _, us in s.kernels) or 1.0
        rows = [[i + 1, html.escape(name), _ms(us), f"{us / kernel_total:.1%}"] for i, (name, us) in enumerate(s.kernels[:top])]
        parts.append(_table(["#", "kernel", "ms", "share"], rows))
    else:
        parts.append("<p>No device kernels in this trace (a CPU run).</p>")

    if s.op_shapes:
        parts.append("<h2>compiled_attn ops by input shape</h2>")
        rows = [[i + 1, html.escape(name), html.escape(dims), calls, _ms(us)]
                for i, (name, dims, calls, us) in enumerate(s.op_shapes[:top])]
        parts.append(_table(["#", "op", "input dims (tensors)", "calls", "total ms"], rows, name_cols=(1, 2)))
    if s.memory_peak_bytes:
        parts.append("<h2>Memory</h2>")
        rows = [[html.escape(dev), f"{b / 2**20:.2f}"] for dev, b in s.memory_peak_bytes.items()]
        parts.append(_table(["device", "most MiB allocated while profiling"], rows, name_cols=(0,)))
    props = meta.get("deviceProperties")
    if isinstance(props, list) and props:
        parts.append("<h2>Devices</h2>")
        keys = sorted({k for p in props if isinstance(p, dict) for k in p})
        rows = [[html.escape(str(p.get(k, ""))) for k in keys] for p in props if isinstance(p, dict)]
        parts.append(_table(keys, rows, name_cols=(keys.index("name"),) if "name" in keys else ()))
    parts.append('<p class="meta">Written by <code>compiled-attn profile-report</code>; this file is self-contained '
                 "(styles and picture inline) and needs no network.</p></body></html>")
    return "\n".join(parts)


def default_report_path(trace: str | Path) -> Path:
    """``<trace name without .pt.trace.json[.gz]>.report.html`` next to the trace."""
    trace = Path(trace)
    stem = next((trace.name[: -len(x)] for x in _TRACE_SUFFIXES if trace.name.endswith(x)), trace.stem)
    return trace.with_name(stem + ".report.html")


def write_report(path: str | Path, out: str | Path | None = None, *, top: int = 15, steps: int = 3) -> Path:
    """Write the HTML report of a trace and return the file written.

    Args:
        path: a ``--profile`` directory (the trace :func:`find_trace` picks is reported, the
            others are named in the report) or a trace file.
        out: the HTML file (default: :func:`default_report_path` of the trace); its
            directory is created.
        top: rows in the ops and kernels tables.
        steps: steps drawn in the timeline.

    Raises:
        ValueError: ``path`` holds no trace or is not one (see :func:`find_trace`),
            ``top`` or ``steps`` < 1, ``out`` is a directory or the trace itself.
    """
    trace = find_trace(path)
    out = default_report_path(trace) if out is None else Path(out)
    if out.is_dir():
        raise ValueError(f"out {out}: is a directory; name the HTML file to write")
    if out.resolve() == trace.resolve():
        raise ValueError(f"out {out}: is the trace being reported; name another file")
    left_out = [p for p in list_traces(path) if p != trace] if Path(path).is_dir() else []
    text = render_report(trace, top=top, steps=steps, left_out=left_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out

