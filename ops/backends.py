"""CUDA kernels of the ``compiled_attn`` ops, registered when Triton is importable.

Each op keeps one ``torch.library.custom_op`` contract (schema, fake, CPU reference) and
gains a ``cuda`` kernel here through ``register_kernel``; the kernel launches the Triton
kernels of :mod:`compiled_attn.ops.triton_kernels`. Eager calls, ``torch.compile`` (the op
stays opaque, its fake gives shapes) and CUDA-graph capture all see the same op; CPU
tensors keep the reference. A ``triton_op`` would let Inductor see the Triton kernels, but
with CPU tensors under ``TRITON_INTERPRET=1`` it fails inside ``torch.compile`` (fake
tensors reach the interpreter), so the interpreter tests call the launchers
directly instead.

``copy_blocks`` and ``swap_blocks`` keep the reference on every device: it is already two
device-side indexing kernels per cache with exact gather-then-scatter semantics (a one-pass
in-place copy would race when a destination block is also a source), and neither op is on
the per-step path.
"""

from __future__ import annotations

import importlib.util

import torch

from . import reference
from .attention import (
    differential_paged_attention_op,
    differential_varlen_attention_op,
    paged_attention_op,
    varlen_attention_op,
)
from .cache import reshape_and_cache_op
from .linear import fused_linear_op

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None

if TRITON_AVAILABLE:
    from . import triton_kernels

    @paged_attention_op.register_kernel("cuda")
    def _paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table,
                         scale, causal, window_left, window_right, softcap, alibi_slopes):
        return triton_kernels.paged_attention(
            query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, scale=scale,
            causal=causal, window_size=(window_left, window_right), softcap=softcap,
            alibi_slopes=alibi_slopes)

    @differential_paged_attention_op.register_kernel("cuda")
    def _differential_paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens,
                                      block_table, lambda_full, scale, causal, window_left,
                                      window_right, softcap, alibi_slopes):
        return triton_kernels.paged_attention(
            query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full,
            scale=scale, causal=causal, window_size=(window_left, window_right),
            softcap=softcap, alibi_slopes=alibi_slopes)

    @varlen_attention_op.register_kernel("cuda")
    def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window_left,
                          window_right, softcap, alibi_slopes):
        return triton_kernels.varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal,
            window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes)

    @differential_varlen_attention_op.register_kernel("cuda")
    def _differential_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale,
                                       causal, window_left, window_right, softcap, alibi_slopes):
        return triton_kernels.varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale=scale, causal=causal,
            window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes)

    @reshape_and_cache_op.register_kernel("cuda")
    def _reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
        triton_kernels.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    @fused_linear_op.register_kernel("cuda")
    def _fused_linear(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul):
        if x.dtype == torch.float64:  # the kernels accumulate in float32
            return reference.fused_linear(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul)
        return triton_kernels.fused_linear(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul)
