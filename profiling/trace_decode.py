"""Record a profiler trace of graph-replayed (or eager) decode and summarize it.

    python profiling/trace_decode.py --device cuda --out runs/trace --timeline timeline.svg

Writes the TensorBoard/Perfetto/HTA trace into ``--out``, prints the summary (top ops and
kernels by self time, each phase's share of a step, decode-step statistics) and the path of
the offline HTML report beside the trace (``compiled-attn profile-report``); with
``--timeline``, also draws the report's picture alone: the phases, our ops and the device
kernels of the last few decode steps (``.svg``: as in the report; any other suffix, e.g.
``.png``: with matplotlib, from the same lanes).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from compiled_attn.benchmark import BENCH_CONFIG
from compiled_attn.engine import Engine
from compiled_attn.models import build_random_model, load_diffllama, random_model_config
from compiled_attn.profile_report import timeline_lanes, timeline_svg, write_report
from compiled_attn.profiler import StepProfiler, load_trace, summarize_trace
from compiled_attn.sampling import SamplingParams


def draw_timeline(trace: Path, out: Path, steps: int = 3) -> None:
    """The report's timeline of the last ``steps`` steps of ``trace`` as ``out``: an SVG file
    for ``.svg``, else an image drawn with matplotlib (``pip install -e '.[profiling]'``)."""
    events = load_trace(trace)
    if out.suffix == ".svg":
        # A standalone SVG file needs the namespace that inline HTML does without.
        svg = timeline_svg(events, steps=steps)
        out.write_text(svg.replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1), encoding="utf-8")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, end, lanes = timeline_lanes(events, steps)
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.55 * len(lanes)))
    for row, (_, shown) in enumerate(lanes):
        bars = [((max(e["ts"], start) - start) / 1e3, max((min(e["ts"] + e["dur"], end) - max(e["ts"], start)) / 1e3, 1e-3))
                for e, _ in shown]
        ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=[c for _, c in shown] or "none", edgecolor="none")
    ax.set_yticks(range(len(lanes)), [lane for lane, _ in lanes])
    ax.invert_yaxis()
    ax.set_xlim(0, (end - start) / 1e3)
    ax.set_xlabel("ms (red: attention, green: reshape_and_cache, orange: split-KV merge, blue: other)")
    ax.set_title(f"last {steps} steps of {trace.name}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="Hugging Face DiffLlama dir (default: random weights of random_model_config())")
    parser.add_argument("--bench-model", action="store_true",
                        help="random weights of compiled-attn bench's ~1.1B config instead of random_model_config()")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="decode steps to record")
    parser.add_argument("--out", type=Path, default=Path("runs/trace"))
    parser.add_argument("--timeline", type=Path, help="draw the last recorded steps (.svg, or .png with matplotlib)")
    parser.add_argument("--timeline-steps", type=int, default=3, help="steps drawn in the timeline")
    parser.add_argument("--shapes", action="store_true", help="record input shapes")
    parser.add_argument("--stack", action="store_true", help="record Python stacks")
    parser.add_argument("--memory-snapshot", type=Path)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config = BENCH_CONFIG if args.bench_model else random_model_config()
    model = (load_diffllama(args.model, dtype, args.device) if args.model
             else build_random_model(config, dtype=dtype, device=args.device))
    engine = Engine(model, max_num_seqs=max(args.batch, 1))
    prompts = [[(7 * i + j) % 200 + 32 for j in range(32 + 8 * i)] for i in range(args.batch)]
    engine.generate(prompts, SamplingParams(max_new_tokens=4))  # compile and capture
    profiler = StepProfiler(args.out, skip_first=1, active=args.steps, memory_snapshot=args.memory_snapshot,
                            record_shapes=args.shapes, with_stack=args.stack, device=args.device)
    with profiler:
        engine.generate(prompts, SamplingParams(max_new_tokens=args.steps + 2), on_step=profiler.step)
    trace = profiler.written[-1]
    print(f"trace: {trace}")
    print(summarize_trace(trace).format())
    print(f"report: {write_report(trace, steps=args.timeline_steps)}")
    if args.timeline:
        draw_timeline(trace, args.timeline, args.timeline_steps)
        print(f"timeline: {args.timeline}")


if __name__ == "__main__":
    main()
