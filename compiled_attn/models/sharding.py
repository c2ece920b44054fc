"""Megatron-style tensor-parallel sharding of a :class:`DiffLlamaForCausalLM`.

Shoeybi et al., "Megatron-LM", arXiv 1909.08053 §3, as vLLM's parallel layers do it:

* column-parallel (split by output rows of the weight, no collective): ``qkv_proj`` (its
  Q, K and V blocks each sliced by heads, vLLM ``QKVParallelLinear``), ``q_proj`` of a layer
  that shares a KV cache, ``gate_up_proj`` (gate and up each sliced, vLLM
  ``MergedColumnParallelLinear``);
* row-parallel (split by input columns, one all-reduce after; bias on rank 0 only):
  ``o_proj``, ``down_proj`` (vLLM ``RowParallelLinear``);
* vocab-parallel: ``embed_tokens`` (each rank embeds the ids in its vocabulary range, zeros
  elsewhere, then an all-reduce; vLLM ``VocabParallelEmbedding``) and ``lm_head`` (each rank
  computes its vocabulary's logits, then an all-gather, so every rank samples the same
  tokens from the same full logits).

Differential heads are interleaved pairs (``2j``, ``2j + 1``), so a contiguous slice of an
even number of heads holds whole pairs: rank ``r`` gets query pairs ``[r P/tp, (r+1) P/tp)``
and KV pairs ``[r G/tp, (r+1) G/tp)`` (``P``, ``G`` pairs), keeping GQA's group mapping and
caching whole pairs. ``lambda_*`` (one λ per layer) and ``subln`` (one RMSNorm over ``2D``,
shared by the pairs) are replicated, so they stay per pair.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..distributed import TensorParallel, all_reduce
from ..layers import Attention, DifferentialAttention
from .config import DiffLlamaConfig
from .diffllama import MLP, DiffLlamaForCausalLM


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + weight.shape[0])`` of an embedding; ``[T]`` ids ->
    ``[T, hidden]`` summed over the ranks (ids outside this rank's range embed as zeros)."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        embedded = nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        return all_reduce(embedded * inside.unsqueeze(-1).to(embedded.dtype), self.tp)


def check_tensor_parallel(config: DiffLlamaConfig, world_size: int) -> None:
    """Raise ``ValueError`` unless ``config`` splits evenly over ``world_size`` ranks.

    Needed: query pairs (``num_attention_heads / 2``), KV pairs (``num_key_value_heads / 2``),
    ``intermediate_size`` and ``vocab_size`` each divisible by ``world_size``: a rank holds
    whole head pairs and their KV cache. A plain-attention model built from the same config
    (``differential=False``) splits by pairs too: its shard's config must be valid.
    """
    sizes = {"query head pairs (num_attention_heads / 2)": config.num_attention_heads // 2,
             "KV head pairs (num_key_value_heads / 2)": config.num_key_value_heads // 2,
             "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    bad = [f"{name} = {n}" for name, n in sizes.items() if n % world_size]
    if bad:
        raise ValueError(f"tensor parallelism over {world_size} ranks (--tensor-parallel-size) needs each of "
                         f"these divisible by {world_size}: {', '.join(bad)}")


def shard_config(config: DiffLlamaConfig, world_size: int) -> DiffLlamaConfig:
    """One rank's sizes: heads and ``intermediate_size`` divided by ``world_size``
    (``vocab_size`` stays whole: the logits are gathered). Raises as :func:`check_tensor_parallel`."""
    check_tensor_parallel(config, world_size)
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world_size,
                               num_key_value_heads=config.num_key_value_heads // world_size,
                               intermediate_size=config.intermediate_size // world_size)


def _rows(t: torch.Tensor | None, blocks: list[tuple[int, int]], rank: int, world_size: int):
    """Rank ``rank``'s slice of each ``(offset, size)`` block of ``t``'s rows, concatenated."""
    if t is None:
        return None
    n = [size // world_size for _, size in blocks]
    return torch.cat([t[off + rank * k: off + (rank + 1) * k] for (off, _), k in zip(blocks, n)]).contiguous()


def _set(layer: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    layer.out_features, layer.in_features = weight.shape


def _column(layer: nn.Linear, blocks: list[tuple[int, int]], tp: TensorParallel) -> None:
    _set(layer, _rows(layer.weight, blocks, tp.rank, tp.world_size), _rows(layer.bias, blocks, tp.rank, tp.world_size))


def _row(layer: nn.Linear, tp: TensorParallel) -> None:
    n = layer.in_features // tp.world_size
    bias = None if layer.bias is None else (layer.bias if tp.rank == 0 else torch.zeros_like(layer.bias))
    _set(layer, layer.weight[:, tp.rank * n:(tp.rank + 1) * n], bias)


@torch.no_grad()
def shard_model(model: DiffLlamaForCausalLM, tp: TensorParallel) -> DiffLlamaForCausalLM:
    """Turn a full ``model`` into rank ``tp.rank``'s shard, in place, and return it.

    Slices every weight as the module docstring says and sets the layers' ``tp`` (their
    row-parallel outputs are all-reduced, the logits all-gathered). The model keeps its full
    ``config``; ``model.tp_config`` holds this rank's sizes (:func:`shard_config`), which the
    engine's KV cache uses (``num_key_value_heads / tp`` heads per layer). ``world_size == 1``
    returns ``model`` unchanged (no collectives anywhere).

    Raises:
        ValueError: sizes that do not divide by ``tp.world_size`` (:func:`check_tensor_parallel`),
            or a model that is a shard already (``model.tp_config`` set); checked before any
            weight changes.
    """
    if tp.world_size == 1:
        return model
    if getattr(model, "tp_config", None) is not None:
        raise ValueError("model is a tensor-parallel shard already (model.tp_config is set): shard a full "
                         "model once, e.g. load_diffllama(path, tp=tp) or shard_model(load_diffllama(path), tp)")
    config, r, w = model.config, tp.rank, tp.world_size
    model.tp_config = shard_config(config, w)
    for module in model.modules():
        if isinstance(module, Attention):
            hq, hkv, d = module.num_heads, module.num_kv_heads, module.head_size
            if module.shares_kv_cache:
                _column(module.q_proj, [(0, hq * d)], tp)
            else:
                _column(module.qkv_proj, [(0, hq * d), (hq * d, hkv * d), ((hq + hkv) * d, hkv * d)], tp)
            _row(module.o_proj, tp)
            module.num_heads, module.num_kv_heads = hq // w, hkv // w
            if module.alibi_slopes is not None:
                module.alibi_slopes = module.alibi_slopes[r * hq // w:(r + 1) * hq // w].contiguous()
            module.tp = tp
        elif isinstance(module, MLP):
            i = module.down_proj.in_features
            _column(module.gate_up_proj, [(0, i), (i, i)], tp)
            _row(module.down_proj, tp)
            module.tp = tp
    assert all(not isinstance(m, DifferentialAttention) or m.num_heads % 2 == 0 for m in model.modules())
    v = config.vocab_size // w
    embed = model.model.embed_tokens.weight
    model.model.embed_tokens = VocabParallelEmbedding(embed[r * v:(r + 1) * v].contiguous(), r * v, tp)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        model.lm_head.out_features = v
    else:
        _column(model.lm_head, [(0, config.vocab_size)], tp)
    model.tp = tp
    return model
