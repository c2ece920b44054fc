"""The training loop of ``compiled-attn train`` (:class:`Trainer`, :func:`train`); see
:mod:`compiled_attn.train` for what a run computes and writes."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .compile import CompiledFunction, CompileStats
from .data import IGNORE_INDEX, Corpus, PackedBatch, TokenStream, load_corpus, pack_rows, stdlib_root, train_rows
from .models import build_random_model
from .ops.arith import cdiv
from .train_checkpoints import load_weights, read_checkpoint, save_model, write_checkpoint
from .train_config import EXPORT_DTYPES, TrainConfig, latest_checkpoint, settings_of
from .train_optim import adamw, learning_rate
from .train_throughput import parameter_counts, throughput


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


class Trainer:
    """One training run of :class:`TrainConfig` (see :mod:`compiled_attn.train`); :meth:`run`.

    Args:
        config: the run.
        corpus: the data already read (to share it between runs); it must be of
            ``config.data_root`` and ``config.val_fraction``. ``None``: read it.
        log: where messages go.

    Raises:
        ValueError: the data leaves fewer than ``batch_rows`` training rows; ``corpus`` of
            another root or split; a resume checkpoint that is missing, unreadable or made
            with other trajectory settings; a fresh run (no ``resume``) into an ``out_dir``
            that holds checkpoints of an earlier run (runs would mix there).
        FileNotFoundError: ``config.data_root`` is not a directory.
    """

    def __init__(self, config: TrainConfig, corpus: Corpus | None = None, log: Callable[[str], None] = print):
        self.config = config
        self.log = log
        earlier = latest_checkpoint(config.out_dir)
        if config.resume is None and earlier is not None:
            raise ValueError(f"out_dir {config.out_dir} holds checkpoints of an earlier run ({earlier.name}): "
                             "continue it with resume='latest' (--resume latest) or train into another out_dir")
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
            state = read_checkpoint(config.resume, config)
            self.model = load_weights(config.resume, config)
            self.start_step = state["step"]
            self.history = list(state["losses"])
            self.val_history = [tuple(v) for v in state["val_history"]]
        else:
            self.model = build_random_model(config.model, seed=config.seed, differential=config.differential)
        self.model = self.model.to(self.device).train().requires_grad_(True)
        self.optimizer = adamw(self.model, config, self.device)
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
        rows = min(stream.num_rows(self.config.seq_len), cdiv(self.config.val_tokens, self.config.seq_len))
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

    def save_model(self, directory: Path, dtype: torch.dtype | None = None) -> Path:
        """The model in ``directory`` (:func:`~compiled_attn.train_checkpoints.save_model`)."""
        return save_model(self.model, self.config.model, directory, dtype)

    def checkpoint(self, step: int) -> Path:
        """Write ``checkpoints/step_NNNNNN`` (float32 weights + ``trainer_state.pt``); a
        partly written one never has the final name."""
        return write_checkpoint(self.config, step, self.model, self.optimizer, self.history, self.val_history)

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> TrainResult:
        """Train from ``start_step`` to ``steps`` (or until ``max_seconds``), validating and
        checkpointing as set, then export ``model/`` (when finished, with ``training.json``:
        the summary but its ``export`` entry) and write ``summary.json``; returns the
        :class:`TrainResult`.

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
        finished_summary = self._finished_summary()
        if finished_summary is not None:
            self.log(f"{c.resume} is the last step ({c.steps}) of a finished run: nothing to train, "
                     f"{c.out_dir / 'summary.json'} kept")
            return TrainResult([], self.start_step, list(self.val_history), finished_summary, True)
        if c.resume is not None:
            self.log(f"resuming from {c.resume} at step {self.start_step}")
        data = self._data_summary()
        self.log(f"data: {data['train_files']} files, {data['train_tokens']:,} training tokens in {data['root']}; "
                 f"{c.steps} steps read them {data['epochs']:.3g} times")
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
        if export is not None:  # how the model was trained, beside its weights (a model card)
            card = {key: value for key, value in summary.items() if key != "export"}
            (export / "training.json").write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")
        return TrainResult(run_losses, self.start_step, list(self.val_history), summary, finished)

    def _finished_summary(self) -> dict | None:
        """The ``summary.json`` of this run when it resumed at its last step and that summary
        says the run finished (so resuming a finished run keeps its figures), else ``None``."""
        path = self.config.out_dir / "summary.json"
        if self.start_step != self.config.steps or not path.is_file():
            return None
        summary = json.loads(path.read_text(encoding="utf-8"))
        return summary if summary.get("finished") and summary.get("steps_done") == self.config.steps else None

    def _data_summary(self) -> dict:
        """Where the training bytes came from and how often the whole run reads them."""
        c, train = self.config, self.corpus.train
        return {"root": str(self.corpus.root), "train_files": len(train.files), "train_tokens": train.num_tokens,
                "val_tokens": self.corpus.val.num_tokens,
                "epochs": c.steps * c.batch_rows * c.seq_len / max(train.num_tokens, 1)}

    def _summary(self, losses, windows: list[tuple[int, float]], mean_keys, export: Path | None) -> dict:
        """The ``summary.json`` object; its ``throughput`` as
        :func:`~compiled_attn.train_throughput.throughput`."""
        c = self.config
        return {
            "settings": settings_of(c),
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "attention": "differential" if c.differential else "plain",
            "data": self._data_summary(),
            "parameters": parameter_counts(self.model),
            "steps": c.steps, "start_step": self.start_step, "steps_done": self.start_step + len(losses),
            "finished": export is not None, "tokens_per_step": c.batch_rows * c.seq_len,
            "tokens_trained": (self.start_step + len(losses)) * c.batch_rows * c.seq_len,
            "final_train_loss": losses[-1] if losses else None,
            "val_bits_per_byte": self.val_history[-1][1] if self.val_history else None,
            "val_history": [list(v) for v in self.val_history],
            "throughput": throughput(self.model, c, self.device, windows, mean_keys),
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
