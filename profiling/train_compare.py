"""DIFF vs plain Transformer at equal size, in the spirit of the Differential Transformer paper.

Ye et al., "Differential Transformer" (arXiv 2410.05258), §3: DIFF Transformer reaches a lower
language-modeling loss than a Transformer of the same size and token budget. Here both models
are our byte-level Llama (:mod:`compiled_attn.train`) with the same projection shapes, so the
same parameter count up to the differential layers' ``lambda_q1/k1/q2/k2`` (``4 * head_dim``
per layer): the DIFF model pairs its ``num_attention_heads`` single heads into ``H / 2``
differential heads with ``2 * head_dim`` values each (the paper's ``h = d_model / 2d``), the
plain one attends with ``H`` heads of ``head_dim``. Same data (the standard library's ``.py``
files), same split, same row order, schedule, seeds and token budget; the metric is validation
bits per byte at the end. Both counts are reported.

For each seed the table (appended to ``<results_dir>/train.md`` and ``train.jsonl``; a
``--tiny`` run only prints it unless ``--results-dir`` is given) has the
DIFF model's validation bits per byte against the plain model's (ratio < 1: DIFF is better),
their training throughput, and the mean over seeds.

Runs are kept in ``--out-dir`` (one directory per model and seed): a finished run with the
same settings is reused, an unfinished one continues from its latest checkpoint. With
``--max-seconds`` the script stops (exit status 3, no table) when its time is spent; running
the same command again continues, so a long comparison fits machines that cap one command's
time, and its losses are those of an uninterrupted run.

Usage::

    python profiling/train_compare.py --tiny                           # CPU, a few minutes
    python profiling/train_compare.py --seeds 0 1 2 --max-seconds 540  # H200, shipped size; rerun until the table
    python profiling/train_compare.py --seeds 0 1 --steps 300 --batch-rows 32   # the 2026-11-30 table (9.8 M tokens)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from compiled_attn.data import load_corpus
from compiled_attn.results import ResultRow, format_table, write_results
from compiled_attn.train import (
    TINY_RUN, TRAJECTORY_FIELDS, TrainConfig, settings_of, shipped_config, tiny_config, train,
)


def finished_summary(config: TrainConfig) -> dict | None:
    """The ``summary.json`` of a finished run in ``config.out_dir`` made with the same
    trajectory settings, else ``None``."""
    path = config.out_dir / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text(encoding="utf-8"))
    ours = settings_of(config)
    same = all(summary["settings"].get(name) == ours[name] for name in TRAJECTORY_FIELDS)
    return summary if same and summary.get("finished") else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="CPU size: tiny_config(), the --tiny run settings of compiled-attn train, no compile")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one pair of runs per seed")
    parser.add_argument("--steps", type=int, help="default: 200 with --tiny, else 1500")
    parser.add_argument("--batch-rows", type=int, help="default: 8 with --tiny, else 64")
    parser.add_argument("--seq-len", type=int, help="default: 128 with --tiny, else 1024")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"))
    parser.add_argument("--data-root", type=Path, help="default: the standard library")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/compare"), help="the runs' directories")
    parser.add_argument("--results-dir", type=Path,
                        help="where train.md / train.jsonl are appended (default: profiling/results; with "
                             "--tiny, nowhere: the table is only printed)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--max-seconds", type=float,
                        help="stop (exit 3) after this many seconds; the same command continues")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    model = tiny_config() if args.tiny else shipped_config()
    sizes = {"hidden_size": args.hidden_size, "num_hidden_layers": args.layers}
    model = dataclasses.replace(model, **{k: v for k, v in sizes.items() if v is not None})
    run = dict(TINY_RUN) if args.tiny else {"steps": 1500, "batch_rows": 64, "seq_len": 1024, "eval_every": 500,
                                             "val_tokens": 1 << 20, "checkpoint_every": 0}
    for name in ("steps", "batch_rows", "seq_len"):
        if getattr(args, name) is not None:
            run[name] = getattr(args, name)
    run["checkpoint_every"] = 0
    base = TrainConfig(model=model, **run, warmup_steps=min(200, run["steps"] // 10), lr=args.lr,
                       compile=not (args.no_compile or args.tiny), device=args.device, data_root=args.data_root,
                       progress=not args.no_progress)
    corpus = load_corpus(base.data_root, base.val_fraction)
    results = {}
    for seed in args.seeds:
        for differential in (True, False):
            name = f"{'diff' if differential else 'plain'}_seed{seed}"
            config = dataclasses.replace(base, seed=seed, differential=differential, out_dir=args.out_dir / name)
            summary = finished_summary(config)
            if summary is None:
                left = None if args.max_seconds is None else args.max_seconds - (time.perf_counter() - started)
                if left is not None and left <= 0:
                    print(f"time is up before {name}; run the same command again to continue")
                    return 3
                result = train(dataclasses.replace(config, resume="latest", max_seconds=left), corpus)
                if not result.finished:
                    print(f"time is up during {name}; run the same command again to continue")
                    return 3
                summary = result.summary
            results[seed, differential] = summary
            print(f"{name}: {summary['parameters']['total']:,} parameters, validation "
                  f"{summary['val_bits_per_byte']:.4f} bits/byte")

    rows = []
    for seed in args.seeds:
        diff, plain = results[seed, True], results[seed, False]
        counts = f"DIFF {diff['parameters']['total']:,} / plain {plain['parameters']['total']:,} params"
        rows.append(ResultRow(f"seed {seed}: DIFF vs plain ({counts})", "val bits/byte",
                              diff["val_bits_per_byte"], "plain Transformer", plain["val_bits_per_byte"]))
        diff_rate, plain_rate = (r["throughput"]["tokens_per_s_median_window"] for r in (diff, plain))
        if diff_rate and plain_rate:
            rows.append(ResultRow(f"seed {seed}: training throughput", "tokens/s (median window)", diff_rate,
                                  "plain Transformer", plain_rate))
    if len(args.seeds) > 1:
        mean = {d: statistics.mean(results[s, d]["val_bits_per_byte"] for s in args.seeds) for d in (True, False)}
        rows.append(ResultRow(f"mean of {len(args.seeds)} seeds", "val bits/byte", mean[True], "plain Transformer",
                              mean[False]))
    first = results[args.seeds[0], True]
    tokens = first["tokens_trained"]
    title = (f"DIFF vs plain Transformer of equal size (arXiv 2410.05258 §3), byte-level, stdlib .py "
             f"({'tiny' if args.tiny else 'shipped'} size: {model.num_hidden_layers} layers, hidden "
             f"{model.hidden_size}, {model.num_attention_heads} heads of {model.head_dim}, SwiGLU "
             f"{model.intermediate_size}; {base.steps} steps x {base.batch_rows} x {base.seq_len} = {tokens:,} "
             f"tokens, AdamW lr {base.lr:g} warm-up {base.warmup_steps} cosine to {base.min_lr_ratio:g}x, "
             f"{base.precision}, compile {base.compile}, seeds {args.seeds}; ratio < 1: DIFF better)")
    results_dir = args.results_dir or (None if args.tiny else Path("profiling/results"))
    if results_dir is None:
        print(format_table(rows, title))
    else:
        print(write_results(rows, results_dir, "train", title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
