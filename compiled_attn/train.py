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

The code lives in one module per part, all re-exported here: :mod:`.train_config` (the
settings), :mod:`.train_optim` (optimizer and learning-rate schedule), :mod:`.train_loop`
(the training loop), :mod:`.train_checkpoints` (checkpoints and resume),
:mod:`.train_throughput` (tokens/s and MFU) and :mod:`.train_cli` (the command line).
"""

from .train_checkpoints import STATE_FILE
from .train_cli import TINY_RUN, add_train_arguments, config_from_args, format_summary, run_train_command
from .train_config import (
    EXPORT_DTYPES, PRECISIONS, TRAJECTORY_FIELDS, TrainConfig, latest_checkpoint, settings_of, shipped_config,
    tiny_config,
)
from .train_loop import Trainer, TrainResult, train
from .train_optim import learning_rate
from .train_throughput import PEAK_BF16_FLOPS, flops_per_token, parameter_counts, peak_flops_of

__all__ = [
    "EXPORT_DTYPES", "PEAK_BF16_FLOPS", "PRECISIONS", "STATE_FILE", "TINY_RUN", "TRAJECTORY_FIELDS",
    "TrainConfig", "TrainResult", "Trainer", "add_train_arguments", "config_from_args", "flops_per_token",
    "format_summary", "latest_checkpoint", "learning_rate", "parameter_counts", "peak_flops_of",
    "run_train_command", "settings_of", "shipped_config", "tiny_config", "train",
]
