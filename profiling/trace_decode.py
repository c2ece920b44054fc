"""Record a profiler trace of graph-replayed (or eager) decode and summarize it.

    python profiling/trace_decode.py --device cuda --out runs/trace --timeline trace.png

Writes the TensorBoard/Perfetto trace into ``--out``, prints the summary (top ops and
kernels by self time, each phase's share of a step) and, with ``--timeline``, draws the
phases, our ops and the device kernels of a few decode steps from the trace (matplotlib).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from compiled_attn.benchmark import BENCH_CONFIG
from compiled_attn.engine import Engine
from compiled_attn.models import build_random_model, default_config, load_diffllama
from compiled_attn.profiler import StepProfiler, load_trace, summarize_trace
from compiled_attn.sampling import SamplingParams


def plot_timeline(trace: Path, png: Path, steps: int = 3) -> None:
    """Phases, ``compiled_attn`` ops and device kernels of the last ``steps`` profiled steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = load_trace(trace)
    spans = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])[-steps:]
    start, end = spans[0]["ts"], spans[-1]["ts"] + spans[-1]["dur"]
    lanes = {
        "steps": [e for e in spans],
        "phases": [e for e in events if e.get("cat") == "user_annotation" and e["name"] in ("prefill", "decode_step", "replay")],
        "our ops (CPU)": [e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("compiled_attn::")],
        "kernels (GPU)": [e for e in events if e.get("cat") == "kernel"],
    }
    colors = {"reshape_and_cache": "tab:green", "merge": "tab:orange", "attention": "tab:red"}
    fig, ax = plt.subplots(figsize=(12, 3.2))
    for row, (lane, lane_events) in enumerate(lanes.items()):
        shown = [e for e in lane_events if start <= e["ts"] <= end]
        bars = [((e["ts"] - start) / 1e3, max(e["dur"] / 1e3, 1e-3)) for e in shown]
        color = [next((c for k, c in colors.items() if k in e["name"]), "tab:blue") for e in shown]
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=color or "tab:blue", edgecolor="none")
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.invert_yaxis()
    ax.set_xlabel("ms (red: attention, green: reshape_and_cache, orange: split-KV merge, blue: other)")
    ax.set_title(f"{len(spans)} decode steps from {trace.name}")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="Hugging Face DiffLlama dir (default: embedded model)")
    parser.add_argument("--bench-model", action="store_true",
                        help="random weights of compiled-attn bench's ~1.1B config instead of the embedded model")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="decode steps to record")
    parser.add_argument("--out", type=Path, default=Path("runs/trace"))
    parser.add_argument("--timeline", type=Path, help="draw a PNG timeline of the recorded steps")
    parser.add_argument("--memory-snapshot", type=Path)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config = BENCH_CONFIG if args.bench_model else default_config()
    model = (load_diffllama(args.model, dtype, args.device) if args.model
             else build_random_model(config, dtype=dtype, device=args.device))
    engine = Engine(model, max_num_seqs=max(args.batch, 1))
    prompts = [[(7 * i + j) % 200 + 32 for j in range(32 + 8 * i)] for i in range(args.batch)]
    engine.generate(prompts, SamplingParams(max_new_tokens=4))  # compile and capture
    profiler = StepProfiler(args.out, skip_first=1, active=args.steps, memory_snapshot=args.memory_snapshot)
    with profiler:
        engine.generate(prompts, SamplingParams(max_new_tokens=args.steps + 2), on_step=profiler.step)
    trace = profiler.trace_files()[-1]
    print(f"trace: {trace}")
    print(summarize_trace(trace).format())
    if args.timeline:
        plot_timeline(trace, args.timeline)
        print(f"timeline: {args.timeline}")


if __name__ == "__main__":
    main()
