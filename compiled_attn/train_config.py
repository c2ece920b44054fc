"""Settings of a ``compiled-attn train`` run (:class:`TrainConfig`), their checks, the two
model sizes it ships (:func:`shipped_config`, :func:`tiny_config`) and the JSON form that
``summary.json`` and checkpoints record (:func:`settings_of`)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .models import DiffLlamaConfig

PRECISIONS = ("bf16", "fp32")
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shipped_config() -> DiffLlamaConfig:
    """The model ``compiled-attn train`` trains by default (meant to become the embedded
    default of ``compiled-attn generate``): 8 layers, hidden 256, 8 heads of 32 (4
    differential pairs), 8 KV heads, SwiGLU width 768, 256 byte tokens, untied head, no
    EOS; about 6.95 M parameters (13.9 MB of bf16 safetensors)."""
    return DiffLlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    )


def tiny_config() -> DiffLlamaConfig:
    """A CPU-sized model for smoke runs and tests: 2 layers, hidden 64, 4 heads of 16
    (2 pairs), 2 KV heads, SwiGLU width 128, 256 byte tokens (about 0.11 M parameters)."""
    return DiffLlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    )


@dataclass
class TrainConfig:
    """Settings of one training run (``compiled-attn train`` flags of the same names).

    Attributes:
        out_dir: where checkpoints, the final model, the log and the summary go.
        model: the architecture (``vocab_size`` must be at least 256: byte tokens).
        differential: DiffLlama (``True``) or the same network with plain attention.
        steps: optimizer steps of the whole run (a resumed run counts from its checkpoint).
        batch_rows: rows per step; a step sees ``batch_rows * seq_len`` tokens.
        seq_len: tokens per row (documents inside a row are separate varlen sequences);
            at most ``model.max_position_embeddings``.
        lr: peak learning rate; min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``.
        warmup_steps: linear warm-up steps (``< steps``).
        weight_decay: AdamW decoupled weight decay on matrices (embeddings included).
        betas, eps: AdamW moments.
        grad_clip: clip the global gradient 2-norm to this (0 = off).
        seed: initial weights and row order.
        compile: run forward + backward under ``torch.compile(fullgraph=True)``.
        device: ``"cuda"`` or ``"cpu"``; ``None`` = cuda when available.
        precision: ``"bf16"`` (mixed, float32 master weights) or ``"fp32"``; ``None`` =
            bf16 on cuda, fp32 on cpu.
        eval_every: validate every this many steps (and at the end); 0 = only at the end.
        val_tokens: validation tokens per evaluation (the first whole rows of the split).
        checkpoint_every: write a checkpoint every this many steps (and at the end); 0 =
            only at the end.
        log_every: read the loss back (a device sync) and update the log every this many
            steps.
        data_root: directory of ``.py`` files (``None``: the standard library).
        val_fraction: share of files in the validation split.
        export_dtype: dtype of the final ``model/`` (``"bfloat16"``, ``"float16"``,
            ``"float32"``); checkpoints stay in float32.
        peak_flops: the device's peak FLOP/s for MFU (``None``:
            :data:`~compiled_attn.train_throughput.PEAK_BF16_FLOPS`
            by GPU name when training in bf16, else no MFU).
        progress: show a tqdm progress bar.
        resume: a checkpoint directory (``.../checkpoints/step_NNNNNN``) to continue from;
            its trajectory settings (:data:`TRAJECTORY_FIELDS`) must equal these. ``"latest"``:
            the checkpoint of ``out_dir`` with the highest step, or a fresh start if it has none.
        max_seconds: stop once this run's loop has taken this many wall seconds: a checkpoint
            is written at the step reached, ``summary.json`` says ``"finished": false`` and no
            ``model/`` is exported; ``resume="latest"`` continues (the same losses as without
            the stop). ``None``: no limit.

    Raises:
        TypeError: a field of the wrong type (the message names it).
        ValueError: a field out of range (the message names it and the allowed range).
    """

    out_dir: Path = Path("runs/train")
    model: DiffLlamaConfig = field(default_factory=shipped_config)
    differential: bool = True
    steps: int = 1500
    batch_rows: int = 64
    seq_len: int = 1024
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 0
    compile: bool = True
    device: str | None = None
    precision: str | None = None
    eval_every: int = 500
    val_tokens: int = 1 << 20
    checkpoint_every: int = 1000
    log_every: int = 10
    data_root: Path | None = None
    val_fraction: float = 0.05
    export_dtype: str = "bfloat16"
    peak_flops: float | None = None
    progress: bool = True
    resume: Path | str | None = None
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        _validate(self)
        self.out_dir = Path(self.out_dir)
        self.data_root = None if self.data_root is None else Path(self.data_root)
        if self.resume == "latest":
            self.resume = latest_checkpoint(self.out_dir)
        self.resume = None if self.resume is None else Path(self.resume)
        self.betas = tuple(float(b) for b in self.betas)
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.precision is None:
            self.precision = "bf16" if self.device == "cuda" else "fp32"


TRAJECTORY_FIELDS = ("model", "differential", "steps", "batch_rows", "seq_len", "lr", "min_lr_ratio",
                     "warmup_steps", "weight_decay", "betas", "eps", "grad_clip", "seed", "precision",
                     "data_root", "val_fraction")
"""Settings that decide the losses of a run: a resumed run must keep them."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _validate(c: TrainConfig) -> None:
    """Types first (TypeError), then ranges (ValueError), each naming the field."""
    def need(name: str, ok: bool, allowed: str, error=ValueError):
        if not ok:
            value = getattr(c, name)
            raise error(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")

    if not isinstance(c.model, DiffLlamaConfig):
        raise TypeError(f"model must be a DiffLlamaConfig, got {type(c.model).__name__}")
    for name in ("differential", "compile", "progress"):
        need(name, isinstance(getattr(c, name), bool), "a bool", TypeError)
    ints = ("steps", "batch_rows", "seq_len", "warmup_steps", "seed", "eval_every", "val_tokens",
            "checkpoint_every", "log_every")
    for name in ints:
        need(name, _is_int(getattr(c, name)), "an int", TypeError)
    floats = ("lr", "min_lr_ratio", "weight_decay", "eps", "grad_clip", "val_fraction")
    for name in floats:
        need(name, _is_number(getattr(c, name)), "a number", TypeError)
    for name in ("out_dir", "data_root", "resume"):
        value = getattr(c, name)
        need(name, isinstance(value, (str, os.PathLike)) or (value is None and name != "out_dir"),
             "a path" + (" or None" if name != "out_dir" else ""), TypeError)
    need("betas", isinstance(c.betas, (tuple, list)) and len(c.betas) == 2 and all(map(_is_number, c.betas)),
         "two numbers", TypeError)
    need("peak_flops", c.peak_flops is None or _is_number(c.peak_flops), "a number or None", TypeError)
    need("max_seconds", c.max_seconds is None or _is_number(c.max_seconds), "a number or None", TypeError)
    for name in (*floats, "peak_flops", "max_seconds"):
        value = getattr(c, name)
        need(name, value is None or math.isfinite(value), "finite")
    for name in ("steps", "batch_rows", "seq_len", "log_every", "val_tokens"):
        need(name, getattr(c, name) >= 1, "an int >= 1")
    for name in ("seed", "eval_every", "checkpoint_every"):
        need(name, getattr(c, name) >= 0, "an int >= 0")
    need("seq_len", c.seq_len <= c.model.max_position_embeddings,
         f"at most model.max_position_embeddings={c.model.max_position_embeddings}")
    need("warmup_steps", 0 <= c.warmup_steps < c.steps, f"an int in [0, steps={c.steps})")
    need("lr", c.lr > 0, "a finite number > 0")
    need("min_lr_ratio", 0 <= c.min_lr_ratio <= 1, "a number in [0, 1]")
    need("weight_decay", c.weight_decay >= 0, "a number >= 0")
    need("eps", c.eps > 0, "a number > 0")
    need("grad_clip", c.grad_clip >= 0, "a number >= 0 (0 = off)")
    need("betas", all(0 <= b < 1 for b in c.betas), "two numbers in [0, 1)")  # NaN fails too
    need("val_fraction", 0 <= c.val_fraction < 1, "a number in [0, 1)")
    need("peak_flops", c.peak_flops is None or c.peak_flops > 0, "a number > 0 or None")
    need("max_seconds", c.max_seconds is None or c.max_seconds > 0, "a number > 0 or None")
    need("device", c.device in (None, "cpu", "cuda"), "'cpu', 'cuda' or None")
    if c.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was given but torch sees no CUDA device")
    need("precision", c.precision in (None, *PRECISIONS), f"one of {PRECISIONS} or None")
    need("export_dtype", c.export_dtype in EXPORT_DTYPES, f"one of {tuple(EXPORT_DTYPES)}")
    need("model", c.model.vocab_size >= 256, "a config with vocab_size >= 256 (byte tokens)")
    need("model", not c.model.kv_sharing, "a config without kv_sharing (training runs without a KV cache)")


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The ``out_dir/checkpoints/step_NNNNNN`` with the highest step, or ``None``."""
    found = sorted(Path(out_dir).glob("checkpoints/step_[0-9]*[0-9]"), key=lambda p: int(p.name[5:]))
    return found[-1] if found else None


def settings_of(config: TrainConfig) -> dict:
    """``config`` as a JSON-ready dict (paths as strings, the model config as a dict with
    string ``kv_sharing`` keys): what ``summary.json`` and checkpoints record, and what
    :data:`TRAJECTORY_FIELDS` are compared on."""
    values = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, DiffLlamaConfig):
            value = dataclasses.asdict(value)
            value["kv_sharing"] = {str(k): v for k, v in value["kv_sharing"].items()}
        elif isinstance(value, Path):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        values[f.name] = value
    if config.data_root is None:
        values["data_root"] = None
    return values
