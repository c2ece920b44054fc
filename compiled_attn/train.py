"""``compiled-attn train``: a byte-level DiffLlama trained through our ops.

The model is :class:`~compiled_attn.models.DiffLlamaForCausalLM` (or, with
``differential=False``, the same network with plain attention), fed packed rows of the
Python standard library's source (:mod:`compiled_attn.data`): every row is cut at document
boundaries into varlen sequences (``cu_seqlens_q``, no padding) and the model runs our
``varlen_attention`` op and ``fused_linear`` with their autograd, forward and backward
under ``torch.compile(fullgraph=True)`` (:class:`~compiled_attn.compile.CompiledFunction`;
optional).

Optimisation: AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", arXiv
1711.05101) with decay on matrices only, a linear warm-up (Goyal et al., arXiv 1706.02677)
then cosine decay to ``min_lr_ratio * lr`` (Loshchilov & Hutter, SGDR, arXiv 1608.03983),
gradient-norm clipping (Pascanu et al., arXiv 1211.5063). On CUDA the step runs in bf16
mixed precision: float32 master weights and optimizer state, bf16 compute. Our custom ops
have no autocast rule, so ``torch.autocast`` alone would leave every projection in float32;
the weights are instead cast to bf16 inside the compiled graph (differentiable casts, as
autocast does for the aten matmuls it knows), the ``lambda_*`` vectors stay float32 and
the loss is computed in float32.

A run writes into ``out_dir``: ``checkpoints/step_NNNNNN/`` (the model as
:func:`~compiled_attn.models.save_diffllama` writes it, plus ``trainer_state.pt``: step,
optimizer state, losses so far), ``model/`` (the final model, in ``export_dtype``),
``log.jsonl`` (training and validation records) and ``summary.json`` (settings,
parameter counts, validation bits per byte, tokens/s and MFU). Nothing is random after
initialisation (no dropout; the rows of step ``s`` are a function of ``seed`` and ``s``),
so a run resumed from a checkpoint computes the losses an uninterrupted run computes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from .compile import CompiledFunction, CompileStats
from .data import IGNORE_INDEX, Corpus, PackedBatch, TokenStream, load_corpus, pack_rows, stdlib_root, train_rows
from .models import DiffLlamaConfig, DiffLlamaForCausalLM, build_random_model, load_diffllama, save_diffllama
from .models.writer import config_to_hf_dict

PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}
"""Dense bf16 tensor-core peak FLOP/s by GPU name (NVIDIA data sheets, SXM parts, no
sparsity), matched as a substring of ``torch.cuda.get_device_name()``."""

PRECISIONS = ("bf16", "fp32")
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STATE_FILE = "trainer_state.pt"


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
        peak_flops: the device's peak FLOP/s for MFU (``None``: :data:`PEAK_BF16_FLOPS`
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
    steps: int = 3000
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


def learning_rate(step: int, config: TrainConfig) -> float:
    """Learning rate of 0-based ``step``: ``lr * (step + 1) / warmup_steps`` during the
    warm-up, then ``lr * (r + (1 - r) * (1 + cos(pi * p)) / 2)`` with ``r = min_lr_ratio``
    and ``p`` going from 0 to 1 over the remaining steps (SGDR's cosine without restarts,
    arXiv 1608.03983, eq. 5)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - 1 - config.warmup_steps)
    ratio = config.min_lr_ratio
    return config.lr * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def parameter_counts(model: DiffLlamaForCausalLM) -> dict[str, int]:
    """``total`` parameters (tied ones once), ``embedding`` (the input table) and
    ``matmul`` (total minus the input table unless tied to the output head: the weights
    each token is multiplied with, plus the few norm and ``lambda_*`` vectors)."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    tied = model.config.tie_word_embeddings
    return {"total": total, "embedding": embedding, "matmul": total - (0 if tied else embedding)}


def flops_per_token(model: DiffLlamaForCausalLM, mean_causal_keys: float) -> dict[str, float]:
    """Training FLOPs per token (forward + backward), two ways.

    ``6 N`` for the ``N`` matmul parameters (Kaplan et al., arXiv 2001.08361, §2.1) plus
    attention: forward per query and key ``4 Hq D`` plain, ``6 Hq D`` differential (two
    score GEMMs of width ``D`` and two ``P [v1, v2]`` GEMMs of width ``2 D`` per pair; the
    count of :mod:`compiled_attn.ops.flops`), times 3 for forward + backward, per layer:

    * ``actual``: keys per query as trained, ``mean_causal_keys`` (causal, within each
      document: ``Σ n (n + 1) / 2 / Σ n`` over the varlen sequences);
    * ``palm``: PaLM's convention (Chowdhery et al., arXiv 2204.02311, App. B:
      ``6 N + 12 L H Q T``), every query against the full row of ``T = seq_len`` keys,
      passed as ``mean_causal_keys`` by the caller that wants it.
    """
    config = model.config
    per_pair = 6 if model.differential else 4
    attention = 3 * config.num_hidden_layers * per_pair * config.num_attention_heads * config.head_dim
    return {"matmul": 6.0 * parameter_counts(model)["matmul"], "attention_per_key": float(attention),
            "total": 6.0 * parameter_counts(model)["matmul"] + attention * mean_causal_keys}


def peak_flops_of(device: torch.device, precision: str, given: float | None) -> float | None:
    """``given``, else the bf16 peak of :data:`PEAK_BF16_FLOPS` for a known CUDA device
    trained in bf16, else ``None`` (no MFU)."""
    if given is not None:
        return given
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


@dataclass
class TrainResult:
    """What a run measured (also in ``summary.json``).

    Attributes:
        losses: training loss (nats per byte) of each step this run made, in step order,
            starting at ``start_step``.
        start_step: first step of this run (0, or the checkpoint's step when resumed).
        val_history: ``(step, bits per byte)`` of each validation.
        summary: the ``summary.json`` object.
        finished: the run reached ``steps`` (``False``: stopped by ``max_seconds``).
    """

    losses: list[float]
    start_step: int
    val_history: list[tuple[int, float]]
    summary: dict
    finished: bool = True


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


class Trainer:
    """One training run of :class:`TrainConfig` (see the module docstring); :meth:`run`.

    Args:
        config: the run.
        corpus: the data already read (to share it between runs); it must be of
            ``config.data_root`` and ``config.val_fraction``. ``None``: read it.
        log: where messages go.

    Raises:
        ValueError: the data leaves fewer than ``batch_rows`` training rows; ``corpus`` of
            another root or split; a resume checkpoint that is missing, unreadable or made
            with other trajectory settings.
        FileNotFoundError: ``config.data_root`` is not a directory.
    """

    def __init__(self, config: TrainConfig, corpus: Corpus | None = None, log: Callable[[str], None] = print):
        self.config = config
        self.log = log
        self.device = torch.device(config.device)
        self.corpus = load_corpus(config.data_root, config.val_fraction) if corpus is None else corpus
        root = stdlib_root() if config.data_root is None else config.data_root
        if (self.corpus.root.resolve(), self.corpus.val_fraction) != (root.resolve(), config.val_fraction):
            raise ValueError(f"corpus was read from {self.corpus.root} with val_fraction={self.corpus.val_fraction}, "
                             f"but the config names {root} with val_fraction={config.val_fraction}")
        self.train_rows = self.corpus.train.num_rows(config.seq_len)
        if self.train_rows < config.batch_rows:
            raise ValueError(f"batch_rows={config.batch_rows} exceeds the {self.train_rows} training rows of "
                             f"seq_len={config.seq_len} in {self.corpus.root}")
        self.compute_dtype = torch.bfloat16 if config.precision == "bf16" else torch.float32
        torch.manual_seed(config.seed)
        self.start_step = 0
        self.history: list[float] = []
        self.val_history: list[tuple[int, float]] = []
        state = None
        if config.resume is not None:
            state = self._read_checkpoint(config.resume)
            self.model = self._load_weights(config.resume, state)
            self.start_step = state["step"]
            self.history = list(state["losses"])
            self.val_history = [tuple(v) for v in state["val_history"]]
        else:
            self.model = build_random_model(config.model, seed=config.seed, differential=config.differential)
        self.model = self.model.to(self.device).train().requires_grad_(True)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr, betas=config.betas, eps=config.eps, fused=self.device.type == "cuda",
        )
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.stats = CompileStats()
        train_loss, eval_loss = self._train_loss, torch.no_grad()(self._eval_loss)
        if config.compile:
            train_loss = CompiledFunction(train_loss, self.stats)
            eval_loss = CompiledFunction(eval_loss, self.stats)
        self.train_loss_fn, self.eval_loss_fn = train_loss, eval_loss

    # --- the step -------------------------------------------------------------------------

    def _logits(self, batch_md) -> torch.Tensor:
        """``[T, vocab]`` float32 logits, weights cast to the compute dtype (bf16 mixed
        precision) except the float32 ``lambda_*`` vectors."""
        if self.compute_dtype == torch.float32:
            return self.model(batch_md, None, all_logits=True)
        params = {name: p if ".lambda_" in name else p.to(self.compute_dtype)
                  for name, p in self.model.named_parameters()}
        return torch.func.functional_call(self.model, params, (batch_md, None), {"all_logits": True})

    def _train_loss(self, md, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (nats) over the tokens that have a target."""
        return F.cross_entropy(self._logits(md), targets, ignore_index=IGNORE_INDEX)

    def _eval_loss(self, md, targets: torch.Tensor) -> torch.Tensor:
        """``[2]``: summed cross-entropy (nats) and the number of tokens with a target."""
        total = F.cross_entropy(self._logits(md), targets, ignore_index=IGNORE_INDEX, reduction="sum")
        return torch.stack([total, (targets != IGNORE_INDEX).sum().float()])

    def batch(self, step: int) -> PackedBatch:
        """The packed rows of 0-based training step ``step``."""
        rows = train_rows(self.train_rows, self.config.batch_rows, step, self.config.seed)
        return pack_rows(self.corpus.train, rows, self.config.seq_len, self.device)

    def evaluate(self) -> float | None:
        """Validation bits per byte: mean cross-entropy over the first ``val_tokens``
        tokens' whole rows of the validation split, in nats, over ``ln 2`` (a token is a
        byte). ``None`` when the split has no whole row."""
        stream: TokenStream = self.corpus.val
        rows = min(stream.num_rows(self.config.seq_len), -(-self.config.val_tokens // self.config.seq_len))
        if rows == 0:
            return None
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for first in range(0, rows, self.config.batch_rows):
            batch = pack_rows(stream, range(first, min(first + self.config.batch_rows, rows)),
                              self.config.seq_len, self.device)
            totals += self.eval_loss_fn(batch.metadata, batch.targets).double()
        self.model.train()
        nats, count = totals.tolist()
        return nats / count / math.log(2)

    # --- checkpoints ----------------------------------------------------------------------

    def _read_checkpoint(self, path: Path) -> dict:
        state_path = Path(path) / STATE_FILE
        if not state_path.is_file():
            raise ValueError(f"resume: {path} is not a checkpoint directory (no {STATE_FILE})")
        try:
            state = torch.load(state_path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch.load raises several types for a bad file
            raise ValueError(f"resume: {state_path} is not readable: {err}") from None
        ours, theirs = settings_of(self.config), state["settings"]
        differ = [name for name in TRAJECTORY_FIELDS if ours[name] != theirs.get(name)]
        if differ:
            detail = ", ".join(f"{n}={theirs.get(n)!r} (now {ours[n]!r})" for n in differ)
            raise ValueError(f"resume: checkpoint {path} was made with other settings: {detail}")
        if not 0 < state["step"] <= self.config.steps:
            raise ValueError(f"resume: checkpoint step {state['step']} is outside (0, steps={self.config.steps}]")
        return state

    def _load_weights(self, path: Path, state: dict) -> DiffLlamaForCausalLM:
        if self.config.differential:
            return load_diffllama(path)
        model = DiffLlamaForCausalLM(self.config.model, differential=False)
        tied = self.config.model.tie_word_embeddings  # lm_head.weight is not stored then
        model.load_state_dict(load_file(Path(path) / "model.safetensors"), strict=not tied)
        return model

    def save_model(self, directory: Path, dtype: torch.dtype | None = None) -> Path:
        """The model in ``directory``: a DiffLlama checkpoint (:func:`save_diffllama`); a
        plain model as its own state dict (our fused names) with a ``config.json`` whose
        ``model_type`` is ``compiled_attn-plain-llama`` (no Hugging Face format)."""
        if self.model.differential:
            return save_diffllama(self.model, directory, dtype=dtype)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
                 for k, v in self.model.state_dict().items()
                 if not (self.config.model.tie_word_embeddings and k == "lm_head.weight")}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
        values = {**config_to_hf_dict(self.config.model, dtype or torch.float32),
                  "model_type": "compiled_attn-plain-llama", "architectures": ["compiled_attn plain Llama"]}
        (directory / "config.json").write_text(json.dumps(values, indent=2) + "\n", encoding="utf-8")
        return directory

    def checkpoint(self, step: int) -> Path:
        """Write ``checkpoints/step_NNNNNN`` (float32 weights + ``trainer_state.pt``); a
        partly written one never has the final name."""
        final = self.config.out_dir / "checkpoints" / f"step_{step:06d}"
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        self.save_model(partial)
        torch.save({"step": step, "optimizer": self.optimizer.state_dict(), "settings": settings_of(self.config),
                    "losses": self.history, "val_history": [list(v) for v in self.val_history]},
                   partial / STATE_FILE)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        return final

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> TrainResult:
        """Train from ``start_step`` to ``steps`` (or until ``max_seconds``), validating and
        checkpointing as set, then export ``model/`` (when finished) and write
        ``summary.json``; returns the :class:`TrainResult`.

        In bf16 on CUDA, float32 matmuls may use TF32 during the run
        (``torch.set_float32_matmul_precision("high")``, restored afterwards): the attention
        backward computes in float32 (:mod:`compiled_attn.ops.gradients`).
        """
        tf32 = self.device.type == "cuda" and self.config.precision == "bf16"
        previous = torch.get_float32_matmul_precision()
        if tf32:
            torch.set_float32_matmul_precision("high")
        try:
            return self._run()
        finally:
            torch.set_float32_matmul_precision(previous)

    def _run(self) -> TrainResult:
        from tqdm.auto import tqdm

        c = self.config
        started = time.perf_counter()
        if c.resume is not None:
            self.log(f"resuming from {c.resume} at step {self.start_step}")
        c.out_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(c.out_dir / "log.jsonl", "a", encoding="utf-8")
        tokens_per_step = c.batch_rows * c.seq_len
        run_losses: list[float] = []
        pending: list[torch.Tensor] = []
        windows: list[tuple[int, float]] = []  # (tokens, seconds) between two syncs, compiles excluded
        causal_pairs, pair_tokens = 0.0, 0
        window_start = None  # wall clock after the last sync; None until the first step is done
        bar = tqdm(total=c.steps, initial=self.start_step, disable=not c.progress, unit="step", dynamic_ncols=True,
                   desc="train DIFF" if c.differential else "train plain")
        grad_norm = torch.zeros(())
        for step in range(self.start_step, c.steps):
            lr = learning_rate(step, c)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            batch = self.batch(step)
            causal_pairs += batch.causal_pairs
            pair_tokens += batch.num_tokens
            loss = self.train_loss_fn(batch.metadata, batch.targets)
            loss.backward()
            if c.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            pending.append(loss.detach())
            done = step + 1
            first_of_run = step == self.start_step
            evaluate = done == c.steps or (c.eval_every and done % c.eval_every == 0)
            stop = c.max_seconds is not None and done < c.steps and time.perf_counter() - started > c.max_seconds
            save = stop or done == c.steps or (c.checkpoint_every and done % c.checkpoint_every == 0)
            if first_of_run or evaluate or save or done % c.log_every == 0:
                values = torch.stack(pending).tolist()  # the sync
                now = time.perf_counter()
                if window_start is not None:
                    windows.append((len(pending) * tokens_per_step, now - window_start))
                pending.clear()
                run_losses += values
                self.history += values
                rate = windows[-1][0] / windows[-1][1] if windows else None
                bar.set_postfix(loss=f"{values[-1]:.3f}", tok_s="-" if rate is None else f"{rate:,.0f}", lr=f"{lr:.2e}",
                                refresh=False)
                bar.update(done - bar.n)
                log_file.write(json.dumps({"step": done, "loss": values[-1], "lr": lr,
                                           "grad_norm": float(grad_norm), "tokens_per_s": rate}) + "\n")
                if evaluate:
                    bpb = self.evaluate()
                    if bpb is not None:
                        self.val_history.append((done, bpb))
                        bar.write(f"step {done}: validation {bpb:.4f} bits/byte")
                        log_file.write(json.dumps({"step": done, "val_bits_per_byte": bpb}) + "\n")
                if save:
                    self.checkpoint(done)
                log_file.flush()
                window_start = time.perf_counter()  # evaluation and checkpoints are not timed
            if stop:
                bar.write(f"stopped after {time.perf_counter() - started:.0f} s (max_seconds={c.max_seconds:g}) at "
                          f"step {done}; continue with --resume latest")
                break
        bar.close()
        log_file.close()
        finished = self.start_step + len(run_losses) == c.steps
        export = self.save_model(c.out_dir / "model", EXPORT_DTYPES[c.export_dtype]) if finished else None
        summary = self._summary(run_losses, windows, causal_pairs / max(pair_tokens, 1), export)
        (c.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        return TrainResult(run_losses, self.start_step, list(self.val_history), summary, finished)

    def _summary(self, losses, windows: list[tuple[int, float]], mean_keys, export: Path | None) -> dict:
        """Throughput: ``tokens_per_s`` over all timed windows (the steps between two loss
        reads, less each run's first step, which compiles, and less evaluation and
        checkpoint time) and the median of the windows' rates (robust to a stray slow
        window, e.g. CPU contention from compile workers after a compile)."""
        c = self.config
        counts = parameter_counts(self.model)
        flops = flops_per_token(self.model, mean_keys)
        palm = flops_per_token(self.model, float(c.seq_len))["total"]
        timed_tokens, timed_seconds = sum(w[0] for w in windows), sum(w[1] for w in windows)
        tokens_per_s = timed_tokens / timed_seconds if timed_seconds > 0 else None
        median = statistics.median(t / s for t, s in windows) if windows else None
        peak = peak_flops_of(self.device, c.precision, c.peak_flops)
        mfu = tokens_per_s * flops["total"] / peak if tokens_per_s and peak else None
        return {
            "settings": settings_of(c),
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "attention": "differential" if c.differential else "plain",
            "parameters": counts,
            "steps": c.steps, "start_step": self.start_step, "steps_done": self.start_step + len(losses),
            "finished": export is not None, "tokens_per_step": c.batch_rows * c.seq_len,
            "tokens_trained": c.steps * c.batch_rows * c.seq_len,
            "final_train_loss": losses[-1] if losses else None,
            "val_bits_per_byte": self.val_history[-1][1] if self.val_history else None,
            "val_history": [list(v) for v in self.val_history],
            "throughput": {
                "tokens_per_s": tokens_per_s, "tokens_per_s_median_window": median,
                "timed_tokens": timed_tokens, "timed_seconds": timed_seconds,
                "mean_causal_keys_per_token": mean_keys, "flops_per_token": flops["total"],
                "flops_per_token_palm": palm, "peak_flops": peak, "mfu": mfu,
            },
            "compile": {"enabled": c.compile, "graphs_compiled": self.stats.graphs_compiled,
                        "graph_breaks": self.stats.graph_breaks, "recompiles": self.stats.recompiles,
                        "compile_seconds": self.stats.compile_seconds},
            "export": None if export is None else {
                "dir": str(export), "dtype": c.export_dtype,
                "bytes": sum(f.stat().st_size for f in export.iterdir() if f.is_file())},
        }


def train(config: TrainConfig, corpus: Corpus | None = None, log: Callable[[str], None] = print) -> TrainResult:
    """Run :class:`Trainer` for ``config`` (``corpus`` preloaded or read from
    ``config.data_root``). See :class:`TrainConfig` and :class:`Trainer` for errors."""
    return Trainer(config, corpus, log).run()


# --- command line -----------------------------------------------------------------------------

def _positive(kind):
    def parse(value: str):
        number = kind(value)
        if not number > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
        return number
    return parse


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


TINY_RUN = {"steps": 200, "batch_rows": 8, "seq_len": 128, "eval_every": 100, "val_tokens": 16384,
            "checkpoint_every": 0}
"""Run settings of ``--tiny`` (with :func:`tiny_config`): about a minute on two CPU cores."""


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``compiled-attn train`` flags (names as :class:`TrainConfig`'s fields)."""
    d = TrainConfig.__dataclass_fields__
    default = {name: d[name].default for name in d if d[name].default is not dataclasses.MISSING}
    ship = shipped_config()
    parser.add_argument("--out", type=Path, default=default["out_dir"], help="output directory")
    parser.add_argument("--plain", action="store_true", help="plain attention (the baseline Llama) instead of DIFF")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run: tiny_config() and the TINY_RUN settings (flags given override both)")
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
             f"{summary['tokens_trained']:,} tokens in {summary['steps']} steps"]
    if not summary["finished"]:
        lines.append(f"stopped at step {summary['steps_done']} of {summary['steps']} (max_seconds): "
                     "rerun with --resume latest to finish")
    bpb = summary["val_bits_per_byte"]
    lines.append(f"validation: {bpb:.4f} bits/byte" if bpb is not None else "validation: no validation rows")
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
