"""The ``compiled-attn train`` command line: its flags, the :class:`TrainConfig` they give
and the summary lines it prints."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from .train_config import EXPORT_DTYPES, PRECISIONS, TrainConfig, shipped_config, tiny_config
from .train_loop import train


def bounded(kind, holds, allowed: str):
    """An argparse ``type``: the value parsed as ``kind`` (``int`` or ``float``) for which
    ``holds(number)``; otherwise an error naming ``allowed`` and what was given."""
    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value!r}") from None
        if not holds(number):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return number
    return parse


def _positive(kind):
    return bounded(kind, lambda number: number > 0, f"{'an int' if kind is int else 'a number'} > 0")


_non_negative_int = bounded(int, lambda number: number >= 0, "an int >= 0")


TINY_RUN = {"steps": 200, "batch_rows": 8, "seq_len": 128, "eval_every": 100, "val_tokens": 16384,
            "checkpoint_every": 0}
"""Run settings of ``--tiny`` (with :func:`tiny_config`): about a minute on two CPU cores."""


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``compiled-attn train`` flags (names as :class:`TrainConfig`'s fields)."""
    d = TrainConfig.__dataclass_fields__
    default = {name: d[name].default for name in d if d[name].default is not dataclasses.MISSING}
    ship = shipped_config()
    parser.add_argument("--out", type=Path, default=default["out_dir"],
                        help=f"output directory (default {default['out_dir']})")
    parser.add_argument("--plain", action="store_true", help="plain attention (the baseline Llama) instead of DIFF")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run: tiny_config() and the TINY_RUN settings, 200 steps of 8 x 128 tokens "
                             "(flags given override both)")
    size = parser.add_argument_group("model size (default: the shipped model, ~6.95 M parameters)")
    size.add_argument("--hidden-size", type=_positive(int), help=f"default {ship.hidden_size}")
    size.add_argument("--layers", type=_positive(int), help=f"default {ship.num_hidden_layers}")
    size.add_argument("--heads", type=_positive(int),
                      help=f"single heads (pairs x 2), default {ship.num_attention_heads}")
    size.add_argument("--kv-heads", type=_positive(int), help=f"default {ship.num_key_value_heads}")
    size.add_argument("--head-dim", type=_positive(int), help=f"default {ship.head_dim}")
    size.add_argument("--intermediate-size", type=_positive(int),
                      help=f"SwiGLU width, default {ship.intermediate_size}")
    size.add_argument("--tie-embeddings", action="store_true", help="share the input table with the output head")
    parser.add_argument("--steps", type=_positive(int), help=f"default {default['steps']}")
    parser.add_argument("--batch-rows", type=_positive(int), help=f"rows per step, default {default['batch_rows']}")
    parser.add_argument("--seq-len", type=_positive(int), help=f"tokens per row, default {default['seq_len']}")
    parser.add_argument("--lr", type=_positive(float), default=default["lr"], help="peak learning rate")
    parser.add_argument("--min-lr-ratio", type=float, default=default["min_lr_ratio"])
    parser.add_argument("--warmup-steps", type=_non_negative_int,
                        help=f"default min({default['warmup_steps']}, steps // 10)")
    parser.add_argument("--weight-decay", type=float, default=default["weight_decay"])
    parser.add_argument("--grad-clip", type=float, default=default["grad_clip"], help="0 = off")
    parser.add_argument("--seed", type=_non_negative_int, default=default["seed"])
    parser.add_argument("--no-compile", action="store_true", help="run eagerly")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--precision", choices=PRECISIONS, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--eval-every", type=_non_negative_int, help=f"0 = at the end; default {default['eval_every']}")
    parser.add_argument("--val-tokens", type=_positive(int), help=f"default {default['val_tokens']}")
    parser.add_argument("--checkpoint-every", type=_non_negative_int,
                        help=f"0 = at the end; default {default['checkpoint_every']}")
    parser.add_argument("--log-every", type=_positive(int), default=default["log_every"])
    parser.add_argument("--data-root", type=Path, help="directory of .py files (default: the standard library)")
    parser.add_argument("--val-fraction", type=float, default=default["val_fraction"])
    parser.add_argument("--export-dtype", choices=tuple(EXPORT_DTYPES), default=default["export_dtype"])
    parser.add_argument("--peak-flops", type=_positive(float),
                        help="device peak FLOP/s for MFU (default: table for H200/H100/A100 in bf16)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--resume", metavar="CHECKPOINT",
                        help="continue from OUT/checkpoints/step_NNNNNN; 'latest' = the newest one in --out "
                             "(or a fresh start if there is none)")
    parser.add_argument("--max-seconds", type=_positive(float),
                        help="stop after this many seconds with a checkpoint (then rerun with --resume latest)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``compiled-attn train`` flags.

    Raises:
        ValueError, TypeError: as :class:`TrainConfig` and :class:`DiffLlamaConfig`.
    """
    base = tiny_config() if args.tiny else shipped_config()
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)} | (TINY_RUN if args.tiny else {})
    run = {name: defaults[name] if getattr(args, name) is None else getattr(args, name)
           for name in ("steps", "batch_rows", "seq_len", "eval_every", "val_tokens", "checkpoint_every")}
    warmup = min(defaults["warmup_steps"], run["steps"] // 10) if args.warmup_steps is None else args.warmup_steps
    sizes = {"hidden_size": args.hidden_size, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
             "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
             "intermediate_size": args.intermediate_size}
    model = dataclasses.replace(base, **{k: v for k, v in sizes.items() if v is not None},
                                tie_word_embeddings=args.tie_embeddings or base.tie_word_embeddings)
    return TrainConfig(
        out_dir=args.out, model=model, differential=not args.plain, **run, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
        warmup_steps=warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip, seed=args.seed,
        compile=not args.no_compile, device=args.device, precision=args.precision, log_every=args.log_every,
        data_root=args.data_root,
        val_fraction=args.val_fraction, export_dtype=args.export_dtype, peak_flops=args.peak_flops,
        progress=not args.no_progress, resume=args.resume, max_seconds=args.max_seconds,
    )


def format_summary(summary: dict) -> str:
    """The lines ``compiled-attn train`` prints at the end."""
    p, t = summary["parameters"], summary["throughput"]
    lines = [f"model: {summary['attention']} attention, {p['total']:,} parameters ({p['matmul']:,} in matmuls); "
             f"{summary['tokens_trained']:,} tokens in {summary['steps_done']} steps"]
    if not summary["finished"]:
        lines.append(f"stopped at step {summary['steps_done']} of {summary['steps']} (max_seconds): "
                     "rerun with --resume latest to finish")
    history = summary["val_history"]
    lines.append(f"validation: {history[-1][1]:.4f} bits/byte (step {history[-1][0]})" if history
                 else "validation: no validation rows")
    if t["tokens_per_s"] is not None:
        mfu = f", MFU {t['mfu'] * 100:.2f}% of {t['peak_flops'] / 1e12:.4g} TFLOP/s" if t["mfu"] is not None else ""
        lines.append(f"throughput: {t['tokens_per_s']:,.0f} tokens/s (median window "
                     f"{t['tokens_per_s_median_window']:,.0f}), {t['flops_per_token'] / 1e6:.1f} MFLOP/token "
                     f"(PaLM convention {t['flops_per_token_palm'] / 1e6:.1f}){mfu} on {summary['device']}")
    c = summary["compile"]
    if c["enabled"]:
        lines.append(f"compile: {c['compile_seconds']:.1f} s, {c['graphs_compiled']} graphs, "
                     f"{c['graph_breaks']} graph breaks, {c['recompiles']} recompiles")
    e = summary["export"]
    if e is not None:
        lines.append(f"model: {e['dir']} ({e['bytes'] / 1e6:.1f} MB, {e['dtype']})")
    return "\n".join(lines)


def run_train_command(args: argparse.Namespace) -> dict:
    """``compiled-attn train``: train, print :func:`format_summary`, return the summary."""
    result = train(config_from_args(args))
    print(format_summary(result.summary))
    return result.summary
