"""Throughput of a ``compiled-attn train`` run: parameter counts, training FLOPs per token,
the device's peak and the tokens/s and MFU that ``summary.json`` reports."""

from __future__ import annotations

import statistics

import torch

from .models import DiffLlamaForCausalLM
from .train_config import TrainConfig

PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}
"""Dense bf16 tensor-core peak FLOP/s by GPU name (NVIDIA data sheets, SXM parts, no
sparsity), matched as a substring of ``torch.cuda.get_device_name()``."""


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


def throughput(model: DiffLlamaForCausalLM, config: TrainConfig, device: torch.device,
               windows: list[tuple[int, float]], mean_keys: float) -> dict:
    """The ``throughput`` object of ``summary.json``: ``tokens_per_s`` over all timed
    ``(tokens, seconds)`` windows (the steps between two loss reads, less each run's first
    step, which compiles, and less evaluation and checkpoint time) and the median of the
    windows' rates (robust to a stray slow window, e.g. CPU contention from compile workers
    after a compile); FLOPs per token with ``mean_keys`` causal keys per query
    (:func:`flops_per_token`) and MFU against :func:`peak_flops_of`."""
    flops = flops_per_token(model, mean_keys)
    palm = flops_per_token(model, float(config.seq_len))["total"]
    timed_tokens, timed_seconds = sum(w[0] for w in windows), sum(w[1] for w in windows)
    tokens_per_s = timed_tokens / timed_seconds if timed_seconds > 0 else None
    median = statistics.median(t / s for t, s in windows) if windows else None
    peak = peak_flops_of(device, config.precision, config.peak_flops)
    mfu = tokens_per_s * flops["total"] / peak if tokens_per_s and peak else None
    return {
        "tokens_per_s": tokens_per_s, "tokens_per_s_median_window": median,
        "timed_tokens": timed_tokens, "timed_seconds": timed_seconds,
        "mean_causal_keys_per_token": mean_keys, "flops_per_token": flops["total"],
        "flops_per_token_palm": palm, "peak_flops": peak, "mfu": mfu,
    }
