"""FLOP formulas of the ``compiled_attn`` ops for ``torch.utils.flop_counter.FlopCounterMode``.

``FlopCounterMode`` sees a custom op as one call (the ops inside its kernel run below the
mode and are not counted), so without a formula our attention counts zero FLOPs. The
functions here count the way torch counts its own kernels (``torch/utils/flop_counter.py``):

* attention counts the two GEMMs per head, as ``sdpa_flop_count`` does, with no discount
  for causal masks, windows or masked entries:

  - plain: ``Σ_seq 2 * Hq * q_len * k_len * (D + Dv)``, i.e. ``4 * Hq * q_len * k_len * D``;
  - differential (fused, per head pair: two score GEMMs of width ``D`` and two
    ``P [v1, v2]`` GEMMs of width ``2 Dv``): ``Σ_seq 4 * (Hq / 2) * q_len * k_len * (D + 2 Dv)``,
    i.e. ``12 * (Hq / 2) * q_len * k_len * D``;
  - sequence lengths are read from the values of ``cu_seqlens_q`` / ``cu_seqlens_k`` /
    ``seq_lens`` when they are real tensors (as ``_flash_attention_forward_flop`` does through
    ``_offsets_to_lengths``; one host read). With FakeTensors, functional tensors or meta
    tensors the values are unknown and the count falls back to the dense upper bound from
    shapes: ``Σ q_len * k_len <= Tq * Tk`` (varlen), ``<= T * max_blocks * block_size``
    (paged);
* the backward of attention is 2.5x the forward (``sdpa_backward_flop_count``: five GEMMs
  against the forward's two). For the fused differential backward of
  :mod:`compiled_attn.ops.gradients` the GEMMs actually issued are 20 (not 30) per
  ``(Hq / 2) * q_len * k_len * D`` (``dO Vᵀ`` is shared by both components and ``dV`` is one
  GEMM with ``A1 - λ A2``); we keep torch's 2.5x convention so the numbers compare with SDPA;
* ``fused_linear`` counts its GEMM, ``2 * T * in * weight.shape[0]`` (``addmm_flop`` ignores
  the bias; pointwise norm and activation are not counted, as torch counts no pointwise op).
  Its backward is not an op: it runs as ordinary ``mm`` calls that the mode counts itself.

Every formula takes the op's arguments raw (tensors, not shapes: ``get_raw=True``) in the op
schema's order and ignores the rest. Importing this module registers them globally
(``torch.utils.flop_counter.register_flop_formula``, keyed by the op's overload packet), so
every ``FlopCounterMode`` counts our ops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils import flop_counter

from .value_checks import values_readable


def attention_flops(num_heads: int, head_size: int, value_size: int, query_key_pairs: float,
                    differential: bool) -> float:
    """GEMM FLOPs of attention over ``query_key_pairs`` (``Σ_seq q_len * k_len``, or the
    pairs a mask keeps: about ``S^2 / 2`` a causal sequence), ``num_heads`` query heads of
    ``head_size`` and values of ``value_size`` (the module docstring's formulas)."""
    if differential:  # per pair: q1 k1ᵀ, q2 k2ᵀ (width D) and A1 [v1,v2], A2 [v1,v2] (width 2Dv)
        return 4 * (num_heads // 2) * query_key_pairs * (head_size + 2 * value_size)
    return 2 * num_heads * query_key_pairs * (head_size + value_size)


def varlen_attention_flops(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           lambda_full: Tensor | None = None, *args: Any, out_val: Any = None,
                           **kwargs: Any) -> int:
    """Forward FLOPs of varlen attention, plain or differential (``lambda_full`` given).

    Args:
        q: ``[Tq, Hq, D]``; k: ``[Tk, Hkv, D]``; v: ``[Tk, Hkv, Dv]``.
        cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` cumulative lengths (values read when real).
        lambda_full: ``None`` for plain attention.

    Returns:
        ``Σ_seq 4 Hq q_len k_len D`` (plain) or ``Σ_seq 12 (Hq/2) q_len k_len D``
        (differential); dense bound ``Tq * Tk`` for the length products with fake tensors.
    """
    if values_readable(cu_seqlens_q) and values_readable(cu_seqlens_k):
        lengths_q = cu_seqlens_q.diff().tolist()
        lengths_k = cu_seqlens_k.diff().tolist()
        pairs = sum(a * b for a, b in zip(lengths_q, lengths_k))
    else:
        pairs = q.shape[0] * k.shape[0]
    return attention_flops(q.shape[1], q.shape[2], v.shape[2], pairs, lambda_full is not None)


def paged_attention_flops(query: Tensor, key_cache: Tensor, value_cache: Tensor, cu_seqlens_q: Tensor,
                          seq_lens: Tensor, block_table: Tensor, lambda_full: Tensor | None = None,
                          *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """Forward FLOPs of paged attention, plain or differential (``lambda_full`` given).

    Args:
        query: ``[T, Hq, D]``; key_cache: ``[num_blocks, block_size, Hkv, D]``;
            value_cache: ``[num_blocks, block_size, Hkv, Dv]``.
        cu_seqlens_q: ``[B + 1]``; seq_lens: ``[B]`` keys per sequence (values read when real);
        block_table: ``[B, max_blocks]`` (only its shape, for the fake-tensor bound).

    Returns:
        As :func:`varlen_attention_flops` with ``k_len = seq_lens[b]``; dense bound
        ``T * max_blocks * block_size`` for the length products with fake tensors.
        Padded graph rows (``seq_len`` 0) count zero.
    """
    if values_readable(cu_seqlens_q) and values_readable(seq_lens):
        lengths_q = cu_seqlens_q.diff().tolist()
        pairs = sum(a * b for a, b in zip(lengths_q, seq_lens.tolist()))
    else:
        pairs = query.shape[0] * block_table.shape[1] * key_cache.shape[1]
    return attention_flops(query.shape[1], query.shape[2], value_cache.shape[3], pairs,
                            lambda_full is not None)


def varlen_attention_backward_flops(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor,
                                    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    lambda_full: Tensor | None = None, *args: Any,
                                    out_val: Any = None, **kwargs: Any) -> int:
    """Backward FLOPs of varlen attention: 2.5x :func:`varlen_attention_flops` (torch's
    ``sdpa_backward_flop_count`` convention: 5 GEMMs against the forward's 2). Schema order of
    ``compiled_attn::varlen_attention_backward`` (``grad_out`` first)."""
    forward = varlen_attention_flops(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full)
    return forward * 5 // 2  # the forward count is even, so this is exact


def fused_linear_flops(x: Tensor, weight: Tensor, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """Forward FLOPs of ``fused_linear``: ``2 * T * in * weight.shape[0]`` (the GEMM only;
    bias, RMSNorm, SwiGLU and residual are pointwise and not counted, as in torch)."""
    num_tokens, in_features = x.shape
    return 2 * num_tokens * in_features * weight.shape[0]


for _name, _formula in {
    "varlen_attention": varlen_attention_flops,
    "paged_attention": paged_attention_flops,
    "varlen_attention_backward": varlen_attention_backward_flops,
    "fused_linear": fused_linear_flops,
}.items():
    flop_counter.register_flop_formula(getattr(torch.ops.compiled_attn, _name), get_raw=True)(_formula)
