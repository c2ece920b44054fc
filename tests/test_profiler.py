"""Profiling traces: written by `generate --profile`, readable, labelled, summarized."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from compiled_attn.cli import main
from compiled_attn.profiler import (StepProfiler, StepStats, add_call_stacks, classify_steps, label_trace_steps,
                                    load_trace, read_trace, summarize_trace, worker_name)


def test_generate_profile_writes_a_labelled_trace(tmp_path, capsys):
    trace_dir = tmp_path / "trace"
    code = main(["generate", "--no-compile", "--json", "--max-new-tokens", "5", "--prompt-ids", "1,2,3",
                 "--prompt-ids", "4,5", "--profile", str(trace_dir)])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    trace = result["profile"]["trace"]
    assert trace.startswith(str(trace_dir)) and trace.endswith(".pt.trace.json")
    with open(trace) as f:
        data = json.load(f)  # TensorBoard and Perfetto read this Chrome trace format
    names = {e.get("name") for e in data["traceEvents"]}
    assert {"prefill", "decode_step"} <= names
    # A named worker (TensorBoard's worker list) and the rank HTA needs.
    assert Path(trace).name.startswith("compiled-attn-cpu-rank0.")
    assert data["distributedInfo"] == {"rank": 0, "world_size": 1}
    assert data["compiled_attn"]["worker"] == "compiled-attn-cpu-rank0"
    assert not any("Input Dims" in e.get("args", {}) for e in data["traceEvents"])  # no shapes unless asked
    assert not any("Call stack" in e.get("args", {}) for e in data["traceEvents"])  # no stacks unless asked
    assert {"compiled_attn::varlen_attention", "compiled_attn::paged_attention",
            "compiled_attn::reshape_and_cache"} <= names
    assert any(n.startswith("ProfilerStep#") for n in names)
    shares = result["profile"]["phase_shares"]
    assert set(shares) == {"prefill", "decode_step", "other"}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["prefill"] > 0 and shares["decode_step"] > 0 and shares["other"] >= 0
    summary = summarize_trace(trace)
    assert summary.steps >= 5  # one prefill and four decode steps
    assert any(name == "compiled_attn::paged_attention" for name, _ in summary.cpu_ops)


def test_summary_self_times_and_shares_on_a_handmade_trace(tmp_path):
    events = [
        {"ph": "X", "name": "ProfilerStep#0", "cat": "user_annotation", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
        {"ph": "X", "name": "prefill", "cat": "user_annotation", "ts": 5, "dur": 60, "pid": 1, "tid": 1},
        {"ph": "X", "name": "ProfilerStep#1", "cat": "user_annotation", "ts": 100, "dur": 50, "pid": 1, "tid": 1},
        {"ph": "X", "name": "decode_step", "cat": "user_annotation", "ts": 110, "dur": 30, "pid": 1, "tid": 1},
        {"ph": "X", "name": "replay", "cat": "user_annotation", "ts": 115, "dur": 20, "pid": 1, "tid": 1},
        {"ph": "X", "name": "outer", "cat": "cpu_op", "ts": 10, "dur": 40, "pid": 1, "tid": 1},
        {"ph": "X", "name": "inner", "cat": "cpu_op", "ts": 15, "dur": 10, "pid": 1, "tid": 1},
        {"ph": "X", "name": "inner", "cat": "cpu_op", "ts": 30, "dur": 5, "pid": 1, "tid": 1},
        {"ph": "X", "name": "k1", "cat": "kernel", "ts": 20, "dur": 10, "pid": 0, "tid": 7},
        {"ph": "X", "name": "k2", "cat": "kernel", "ts": 25, "dur": 10, "pid": 0, "tid": 7},
        {"ph": "X", "name": "k1", "cat": "kernel", "ts": 120, "dur": 4, "pid": 0, "tid": 7},
    ]
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events + [{"ph": "M", "name": "meta"}]}))
    assert len(load_trace(path)) == len(events)
    s = summarize_trace(path)
    assert (s.steps, s.step_us) == (2, 150)
    assert s.phase_us == {"prefill": 60, "decode_step": 30} and s.replay_us == 20
    assert s.shares() == pytest.approx({"prefill": 0.4, "decode_step": 0.2, "other": 0.4})
    assert dict(s.cpu_ops) == {"outer": 25, "inner": 15}
    assert dict(s.kernels) == {"k1": 14, "k2": 10}
    assert s.device_busy_us == 19  # [20, 35) and [120, 124)
    assert "prefill" in s.format()


def test_memory_snapshot_needs_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="memory_snapshot needs CUDA"):
        StepProfiler(tmp_path, memory_snapshot=tmp_path / "snap.pickle")


def _enclosing(events: list[dict], op: dict) -> list[dict]:
    """The python_function spans around ``op`` (its stack), outermost first."""
    return sorted((e for e in events if e.get("cat") == "python_function" and e["tid"] == op["tid"]
                   and e["ts"] <= op["ts"] and op["ts"] + op["dur"] <= e["ts"] + e["dur"]), key=lambda e: e["ts"])


def test_profile_flags_record_shapes_stacks_and_memory_of_our_ops(tmp_path, capsys):
    start = time.perf_counter()
    trace_dir = tmp_path / "trace"
    assert main(["generate", "--no-compile", "--json", "--max-new-tokens", "3", "--prompt-ids", "1,2,3",
                 "--prompt-ids", "4,5", "--profile", str(trace_dir), "--profile-shapes", "--profile-stack",
                 "--profile-memory"]) == 0
    result = json.loads(capsys.readouterr().out)
    data = read_trace(result["profile"]["trace"])
    assert (data["record_shapes"], data["with_stack"], data["profile_memory"]) == (1, 1, 1)
    events = data["traceEvents"]
    ours = [e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("compiled_attn::")]
    assert {e["name"] for e in ours} >= {"compiled_attn::varlen_attention", "compiled_attn::paged_attention",
                                         "compiled_attn::reshape_and_cache"}
    for op in ours:  # input shapes: the query [T, Hq, D] first, for every call
        dims = op["args"]["Input Dims"]
        assert len(dims[0]) == 3 and all(d > 0 for d in dims[0]), (op["name"], dims)
    paged = next(e for e in ours if e["name"] == "compiled_attn::paged_attention")
    stack = [e["name"] for e in _enclosing(events, paged)]
    assert any("compiled_attn/engine.py" in f and "step" in f for f in stack), stack
    assert any("compiled_attn/layers/" in f for f in stack), stack  # the layer that called the op
    for op in ours:  # TensorBoard's "View CallStack" reads args["Call stack"]: the frames, innermost first
        assert sorted(op["args"]["Call stack"].split(";")) == sorted(e["name"] for e in _enclosing(events, op))
    frames = paged["args"]["Call stack"].split(";")
    layer = next(i for i, f in enumerate(frames) if "compiled_attn/layers/" in f)
    assert layer < next(i for i, f in enumerate(frames) if "compiled_attn/engine.py" in f), frames
    assert any(e.get("name") == "[memory]" for e in events)
    summary = summarize_trace(result["profile"]["trace"])
    assert {name for name, *_ in summary.op_shapes} >= {"compiled_attn::paged_attention"}
    assert summary.memory_peak_bytes.get("cpu", 0) > 0
    assert time.perf_counter() - start < 20


def test_add_call_stacks_names_the_enclosing_python_frames_innermost_first(tmp_path):
    def x(name, cat, ts, dur, tid=1):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": {}}

    events = [x("a.py(1): main", "python_function", 0, 100), x("b.py(2): f", "python_function", 10, 30),
              x("c.py(3): g", "python_function", 10, 20),  # starts with f, inside it
              x("op1", "cpu_op", 10, 20),  # the same interval as g: inside g
              x("op2", "cpu_op", 30, 5),  # where g ends: in f only
              x("b.py(4): h", "python_function", 50, 10), x("op3", "cpu_op", 52, 3),
              x("op4", "cpu_op", 70, 5),  # in main only
              x("op5", "cpu_op", 20, 5, tid=2),  # another thread, without frames
              x("op6", "cpu_op", 100, 5)]  # after main
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    expected = {"op1": "c.py(3): g;b.py(2): f;a.py(1): main", "op2": "b.py(2): f;a.py(1): main",
                "op3": "b.py(4): h;a.py(1): main", "op4": "a.py(1): main", "op5": None, "op6": None}
    for _ in range(2):  # running it again changes nothing
        assert add_call_stacks(path) == 4
        assert {e["name"]: e["args"].get("Call stack") for e in load_trace(path) if e["cat"] == "cpu_op"} == expected


def test_trace_ready_takes_only_its_own_complete_traces(tmp_path):
    """Another rank writing into the same directory at the same time (its ``.tmp`` half
    written, or its trace complete) is neither labelled nor listed as this profiler's."""
    import torch

    other = {"traceEvents": [{"ph": "X", "name": "ProfilerStep#0", "cat": "user_annotation", "ts": 0, "dur": 5}]}
    half = tmp_path / "compiled-attn-cpu-rank1.1.pt.trace.json.tmp"
    other_trace = tmp_path / "compiled-attn-cpu-rank1.2.pt.trace.json"
    profiler = StepProfiler(tmp_path, active=2, device="cpu")
    handler = profiler._handler

    def racing_handler(prof):
        half.write_text('{"traceEvents": [')
        other_trace.write_text(json.dumps(other))
        handler(prof)

    profiler._handler = racing_handler
    with profiler:
        for _ in range(3):
            torch.ones(8).sum()
            profiler.step()
    (ours,) = profiler.written
    assert ours.name.startswith(f"{profiler.worker}.") and ours.name.endswith(".pt.trace.json")
    assert json.loads(other_trace.read_text()) == other  # not labelled (it would read IdleStep#0)
    assert set(profiler.trace_files()) == {ours, other_trace}  # no .tmp


def test_a_profile_without_decode_steps_reports_null_decode_statistics(tmp_path, capsys):
    assert main(["generate", "--no-compile", "--json", "--max-new-tokens", "3", "--prompt-ids", "1,2,3",
                 "--profile", str(tmp_path), "--profile-steps", "1"]) == 0
    profile = json.loads(capsys.readouterr().out)["profile"]
    assert profile["decode_steps"] is None  # only the prefill step was profiled
    assert profile["prefill_steps"]["count"] == 1 and profile["prefill_steps"]["total_us"] > 0


def test_prefill_and_decode_steps_are_accounted_apart(tmp_path, capsys):
    trace_dir = tmp_path / "trace"
    assert main(["generate", "--no-compile", "--json", "--max-new-tokens", "4", "--prompt-ids", "1,2,3",
                 "--prompt-ids", "4,5", "--profile", str(trace_dir)]) == 0
    result = json.loads(capsys.readouterr().out)["profile"]
    events = load_trace(result["trace"])
    kinds = classify_steps(events)
    phases = [e for e in events if e.get("cat") == "user_annotation" and e["name"] in ("prefill", "decode_step")]

    def phases_in(step):
        return {e["name"] for e in phases if step["ts"] <= e["ts"] < step["ts"] + step["dur"]}

    # Only decode steps keep the profiler's name (TensorBoard's and HTA's steps); prefill is its own.
    for step, kind in kinds:
        assert step["name"].startswith({"decode": "ProfilerStep#", "prefill": "PrefillStep#",
                                        "idle": "IdleStep#"}[kind]), (step["name"], kind)
        if step["name"].startswith("ProfilerStep#"):
            assert phases_in(step) == {"decode_step"}
    assert [k for _, k in kinds].count("prefill") == 1 and kinds[0][0]["name"] == "PrefillStep#0"
    decode = [step["dur"] for step, kind in kinds if kind == "decode"]
    stats = result["decode_steps"]
    assert stats["count"] == len(decode) >= 3
    assert stats["mean_us"] == pytest.approx(sum(decode) / len(decode))
    assert stats["max_us"] == pytest.approx(max(decode))
    prefill = next(step["dur"] for step, kind in kinds if kind == "prefill")
    assert result["prefill_steps"]["count"] == 1 and result["prefill_steps"]["total_us"] == pytest.approx(prefill)
    assert label_trace_steps(result["trace"]) == {k: [x for _, x in kinds].count(k) for _, k in kinds}  # idempotent
    assert [e["name"] for e, _ in classify_steps(load_trace(result["trace"]))] == [e["name"] for e, _ in kinds]


def _step_trace(path: Path, durations: list[tuple[str | None, float]]) -> Path:
    """A trace of ``ProfilerStep#i`` spans, each holding the given phase (or none)."""
    events, ts = [], 0.0
    for i, (phase, dur) in enumerate(durations):
        events.append({"ph": "X", "name": f"ProfilerStep#{i}", "cat": "user_annotation", "ts": ts, "dur": dur,
                       "pid": 1, "tid": 1})
        if phase:
            events.append({"ph": "X", "name": phase, "cat": "user_annotation", "ts": ts + 1, "dur": dur - 2,
                           "pid": 1, "tid": 1})
        ts += dur
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_decode_step_statistics_exclude_prefill_on_a_handmade_trace(tmp_path):
    path = _step_trace(tmp_path / "t.pt.trace.json", [("prefill", 600.0), ("decode_step", 200.0),
                       ("decode_step", 240.0), ("capture", 900.0), ("decode_step", 160.0), (None, 10.0)])
    before = summarize_trace(path)
    assert label_trace_steps(path) == {"prefill": 1, "decode": 3, "capture": 1, "idle": 1}
    names = [e["name"] for e in load_trace(path) if e["name"].endswith(tuple(f"#{i}" for i in range(6)))]
    assert names == ["PrefillStep#0", "ProfilerStep#1", "ProfilerStep#2", "CaptureStep#3", "ProfilerStep#4",
                     "IdleStep#5"]
    s = summarize_trace(path)
    assert s.step_us_by_kind == before.step_us_by_kind  # the same before and after labelling
    assert (s.steps, s.step_us) == (6, 2110.0)
    assert s.step_stats("decode") == StepStats(3, 600.0, 200.0, 200.0, 240.0, 160.0, 240.0)
    assert s.step_stats() == s.step_stats("decode")
    assert s.step_stats("prefill").as_dict() == {"count": 1, "total_us": 600.0, "mean_us": 600.0,
                                                  "median_us": 600.0, "p90_us": 600.0, "min_us": 600.0,
                                                  "max_us": 600.0}
    assert s.step_stats("capture").count == 1 and s.step_stats("idle").count == 1
    assert StepStats().as_dict() is None  # JSON null, not zeros, when no step of a kind was profiled
    assert "decode steps: 3, mean 0.200 ms" in s.format()
    with pytest.raises(ValueError, match="kind must be one of"):
        s.step_stats("prefil")


def test_worker_name_and_bad_devices(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert worker_name("cpu") == "compiled-attn-cpu-rank0"
    assert worker_name("cuda:1", rank=3) == "compiled-attn-cuda1-rank3"
    monkeypatch.setenv("RANK", "2")
    assert worker_name("cpu") == "compiled-attn-cpu-rank2"  # torchrun's rank
    with pytest.raises(ValueError, match="device: 'gpu'"):
        worker_name("gpu")
    with pytest.raises(TypeError, match="device must be"):
        worker_name(0)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        worker_name("cpu", rank=-1)
    with pytest.raises(ValueError, match="device: 'gpu'"):
        StepProfiler("unused", device="gpu")


def test_every_json_file_in_a_profile_dir_has_a_unique_rank_for_hta(tmp_path, capsys):
    """HTA maps each ``.json``/``.gz`` file in a trace directory to ``distributedInfo.rank``
    and refuses a file without it; the report beside the trace is not one of them."""
    trace_dir = tmp_path / "trace"
    assert main(["generate", "--no-compile", "--json", "--max-new-tokens", "2", "--prompt-ids", "1,2",
                 "--profile", str(trace_dir)]) == 0
    capsys.readouterr()
    assert main(["profile-report", str(trace_dir)]) == 0
    files = [p for p in trace_dir.iterdir() if p.name.endswith((".json", ".gz"))]
    assert len(files) == 1 and any(p.suffix == ".html" for p in trace_dir.iterdir())
    rank = read_trace(files[0])["distributedInfo"]["rank"]
    assert isinstance(rank, int) and rank >= 0


def test_read_trace_rejects_what_is_not_a_trace(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON trace"):
        read_trace(bad)
    bad.write_text(json.dumps({"events": []}))
    with pytest.raises(ValueError, match="no traceEvents list"):
        read_trace(bad)
    for empty in ([1, 2], {"traceEvents": [1, "x"]}, {"traceEvents": []},
                  {"traceEvents": [{"ph": "M", "name": "process_name"}]}):
        bad.write_text(json.dumps(empty))
        with pytest.raises(ValueError, match=rf"path {bad}: holds no complete \(ph 'X'\) events"):
            read_trace(bad)
    event = {"ph": "X", "name": "op", "cat": "cpu_op", "ts": 1.5, "dur": 2}
    for broken, shown in (({"ts": "5"}, "ts='5'"), ({"dur": None}, "dur=None"), ({"name": 3}, "name=3")):
        bad.write_text(json.dumps([1, event, {**event, **broken}]))
        with pytest.raises(ValueError, match=rf"path {bad}: traceEvents\[2\] \(ph 'X'\).*{shown}"):
            load_trace(bad)
    bad.write_text(json.dumps({"traceEvents": [1, "x", event]}))
    assert load_trace(bad) == [event]  # what is not an event object is left out
