"""Profiling traces: written by `generate --profile`, readable, labelled, summarized."""

from __future__ import annotations

import json

import pytest

from compiled_attn.cli import main
from compiled_attn.profiler import StepProfiler, load_trace, summarize_trace


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
