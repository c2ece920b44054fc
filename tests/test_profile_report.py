"""`compiled-attn profile-report`: one self-contained HTML file per trace, readable offline."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from compiled_attn.cli import main
from compiled_attn.profile_report import (COLORS, default_report_path, find_trace, render_report, timeline_lanes,
                                          timeline_svg, write_report)
from compiled_attn.profiler import load_trace, summarize_trace


@pytest.fixture(scope="module")
def cpu_trace_dir(tmp_path_factory) -> Path:
    """A CPU trace of the embedded model with shapes and stacks (written once per module)."""
    trace_dir = tmp_path_factory.mktemp("profile") / "trace"
    assert main(["generate", "--no-compile", "--max-new-tokens", "4", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
                 "--profile", str(trace_dir), "--profile-shapes", "--profile-stack"]) == 0
    return trace_dir


def _no_network_reference(text: str) -> None:
    assert "http" not in text.lower()  # no URL of any scheme http(s) ...
    assert not re.search(r"""(src|href)\s*=|url\(|@import|<script|<link|<iframe|<img""", text, re.I)


def test_report_of_a_cpu_trace_is_self_contained_with_ops_shares_and_picture(cpu_trace_dir, capsys):
    start = time.perf_counter()
    capsys.readouterr()
    assert main(["profile-report", str(cpu_trace_dir)]) == 0
    out = Path(capsys.readouterr().out.strip().removeprefix("report: "))
    trace = find_trace(cpu_trace_dir)
    assert out == default_report_path(trace) and out.parent == cpu_trace_dir
    assert out.name.endswith(".report.html") and ".pt.trace" not in out.name
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    _no_network_reference(text)
    assert "<style>" in text  # styles inline
    for op in ("compiled_attn::paged_attention", "compiled_attn::varlen_attention", "compiled_attn::reshape_and_cache"):
        assert op in text
    summary = summarize_trace(trace)
    for phase, share in summary.shares().items():  # the phase shares, as the summary computes them
        assert re.search(rf"<td class=\"name\">{phase}</td><td>{share:.1%}</td>", text), phase
    svg = re.search(r"<svg .*?</svg>", text, re.S).group(0)  # the picture, inline
    assert svg.count("<rect") > 10 and "our ops (host)" in svg and COLORS["attention"] in svg
    decode = summary.step_stats("decode")
    assert re.search(rf"<td class=\"name\">decode</td><td class=\"name\"><code>ProfilerStep#N</code></td>"
                     rf"<td>{decode.count}</td><td>{decode.total_us / 1e3:.3f}</td><td>{decode.mean_us / 1e3:.3f}</td>",
                     text)
    assert "PrefillStep#N" in text
    assert "compiled_attn ops by input shape" in text  # recorded with --profile-shapes
    assert "record shapes, with stack" in text and "rank 0 of 1" in text
    assert "No device kernels in this trace" in text
    assert time.perf_counter() - start < 20


def test_report_out_and_options(cpu_trace_dir, tmp_path, capsys):
    out = tmp_path / "sub" / "r.html"
    assert main(["profile-report", str(find_trace(cpu_trace_dir)), "--out", str(out), "--top", "3",
                 "--timeline-steps", "1"]) == 0
    assert capsys.readouterr().out.strip() == f"report: {out}"
    text = out.read_text(encoding="utf-8")
    assert "Top 3 host ops" in text
    table = text.split("Top 3 host ops", 1)[1].split("</table>", 1)[0]
    assert table.count("<tr>") == 4  # header and three rows


def _gpu_like_trace(path: Path) -> Path:
    """A handmade trace shaped like a graph-replayed CUDA run: a prefill step, two decode
    steps with replays whose kernels run on the device, and the profiler's idle last step."""
    def x(name, cat, ts, dur, pid=1, tid=1):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}

    events = [x("ProfilerStep#0", "user_annotation", 0, 1000), x("prefill", "user_annotation", 10, 980),
              x("compiled_attn::varlen_attention", "cpu_op", 20, 100), x("attention_kernel", "kernel", 200, 300, 0, 7)]
    for i, t0 in enumerate((1000, 1200), start=1):
        events += [x(f"ProfilerStep#{i}", "user_annotation", t0, 200), x("decode_step", "user_annotation", t0 + 5, 190),
                   x("replay", "user_annotation", t0 + 10, 20), x("cudaGraphLaunch", "cuda_runtime", t0 + 12, 15),
                   x("_paged_attention_kernel", "kernel", t0 + 40, 60, 0, 7),
                   x("reshape_and_cache_kernel", "kernel", t0 + 30, 8, 0, 7),
                   x("_merge_kernel", "kernel", t0 + 100, 10, 0, 7), x("gemm", "kernel", t0 + 110, 40, 0, 7)]
    events.append(x("ProfilerStep#3", "user_annotation", 1400, 5))
    meta = {"distributedInfo": {"rank": 0, "world_size": 1},
            "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150109405184}],
            "compiled_attn": {"device": "cuda", "worker": "compiled-attn-cuda0-rank0"}}
    path.write_text(json.dumps({**meta, "traceEvents": events}))
    return path


def test_report_of_a_gpu_shaped_trace_shows_kernels_replays_and_device_busy(tmp_path):
    trace = _gpu_like_trace(tmp_path / "w.pt.trace.json")
    text = write_report(trace).read_text(encoding="utf-8")
    _no_network_reference(text)
    assert "Device busy" in text and "NVIDIA H200" in text and "CUDA-graph replays" in text
    kernels = text.split("device kernels by time", 1)[1].split("</table>", 1)[0]
    assert "_paged_attention_kernel" in kernels and "gemm" in kernels
    # Decode statistics: the two 200 us decode steps, not the 1000 us prefill or the idle step.
    assert re.search(r"<td class=\"name\">decode</td>.*?<td>2</td><td>0\.400</td><td>0\.200</td>", text)
    start, end, lanes = timeline_lanes(load_trace(trace), steps=2)
    assert (start, end) == (1000, 1400)  # the last two non-idle steps
    by_lane = dict(lanes)
    assert [e["name"] for e, _ in by_lane["graph replays"]] == ["replay", "replay"]
    colors = {e["name"]: c for e, c in by_lane["kernels (device)"]}
    assert colors["_paged_attention_kernel"] == COLORS["attention"]
    assert colors["reshape_and_cache_kernel"] == COLORS["reshape_and_cache"]
    assert colors["_merge_kernel"] == COLORS["merge"] and colors["gemm"] == COLORS["other"]
    assert "attention_kernel" not in colors  # the prefill's kernel lies outside the window
    assert "kernels (device)" in timeline_svg(load_trace(trace), steps=2)


def test_bad_report_inputs_are_clean_errors(tmp_path, capsys):
    assert main(["profile-report", str(tmp_path / "missing")]) == 2
    assert "path " in capsys.readouterr().err
    assert main(["profile-report", str(tmp_path)]) == 2
    assert "holds no *.pt.trace.json trace" in capsys.readouterr().err
    bad = tmp_path / "x.pt.trace.json"
    bad.write_text("not json")
    assert main(["profile-report", str(bad)]) == 2
    assert "not a JSON trace" in capsys.readouterr().err
    good = _gpu_like_trace(tmp_path / "y.pt.trace.json")
    with pytest.raises(ValueError, match="out .*is a directory"):
        write_report(good, tmp_path)
    with pytest.raises(ValueError, match="top must be >= 1"):
        render_report(good, top=0)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        timeline_svg(load_trace(good), steps=0)
    with pytest.raises(ValueError, match="no timed"):
        timeline_svg([])
    with pytest.raises(SystemExit):
        main(["profile-report", str(good), "--top", "0"])
    assert "argument --top: must be an int >= 1, got 0" in capsys.readouterr().err
    empty = "holds no complete (ph 'X') events"
    for text, message in (("[1, 2]", empty), ('{"traceEvents": [1, "x"]}', empty), ('{"traceEvents": []}', empty),
                          ('{"traceEvents": [{"ph": "X", "name": "a", "ts": "0", "dur": 1}]}',
                           "traceEvents[0] (ph 'X') needs a number ts and dur and a string name, got ts='0', dur=1, "
                           "name='a'")):
        bad.write_text(text)
        assert main(["profile-report", str(bad)]) == 2
        assert capsys.readouterr().err == f"compiled-attn: error: path {bad}: {message}\n"


def test_the_report_never_overwrites_its_trace(tmp_path, capsys):
    trace = _gpu_like_trace(tmp_path / "w.pt.trace.json")
    before = trace.read_text()
    for out in (trace, tmp_path / "." / "w.pt.trace.json"):
        with pytest.raises(ValueError, match=r"out .*w\.pt\.trace\.json: is the trace being reported"):
            write_report(tmp_path, out)
    assert main(["profile-report", str(trace), "--out", str(trace)]) == 2
    assert "is the trace being reported" in capsys.readouterr().err
    assert trace.read_text() == before


def test_a_directory_of_several_ranks_reports_rank_0s_newest_and_names_the_rest(tmp_path):
    names = ["compiled-attn-cuda0-rank0.100.pt.trace.json", "compiled-attn-cuda0-rank0.200.pt.trace.json",
             "compiled-attn-cuda1-rank1.300.pt.trace.json"]
    for age, name in zip((30, 20, 10), names):  # seconds old: rank 1's trace is the newest
        mtime = time.time() - age
        os.utime(_gpu_like_trace(tmp_path / name), (mtime, mtime))
    (tmp_path / "compiled-attn-cuda0-rank0.400.pt.trace.json.tmp").write_text('{"traceEv')  # half written
    assert find_trace(tmp_path) == tmp_path / names[1]
    text = write_report(tmp_path).read_text(encoding="utf-8")
    meta = re.search(r'<p class="meta">(.*?)</p>', text).group(1)
    assert meta.startswith(f"trace <code>{names[1]}</code> · the newest of the lowest rank in its directory; "
                           f"left out: <code>{names[0]}</code>, <code>{names[2]}</code> · ")
    assert ".tmp" not in text


def test_profile_flags_need_profile(capsys):
    assert main(["generate", "--no-compile", "--prompt-ids", "1,2", "--profile-shapes", "--profile-memory"]) == 2
    assert "--profile-shapes --profile-memory needs --profile DIR" in capsys.readouterr().err
    assert main(["generate", "--no-compile", "--prompt-ids", "1,2", "--profile-steps", "3"]) == 2
    assert "--profile-steps needs --profile DIR" in capsys.readouterr().err
