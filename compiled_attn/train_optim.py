"""Optimisation of a ``compiled-attn train`` run: AdamW with decay on matrices only and the
warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

from .models import DiffLlamaForCausalLM
from .train_config import TrainConfig


def adamw(model: DiffLlamaForCausalLM, config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters: ``config.weight_decay`` on matrices (``ndim >= 2``,
    embeddings included), none on vectors; fused on CUDA."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=config.betas, eps=config.eps, fused=device.type == "cuda",
    )


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
