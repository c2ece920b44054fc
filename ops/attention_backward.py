"""Gradients of ``varlen_attention`` (training and fine-tuning over packed batches).

The op gets an autograd formula that calls one more op,
``compiled_attn::varlen_attention_backward``, so the backward is as opaque to
``torch.compile`` as the forward (its fake gives the gradient shapes). Its kernel on every
device is the reference backward of :mod:`.gradients` (explicit formulas in plain tensor ops,
recomputing the forward), which runs under any ``TorchDispatchMode`` (FLOP counters, debug
modes) and ``opcheck``; on CUDA, :mod:`.backends` binds the Triton FlashAttention-2 backward
of :mod:`.triton_kernels.attention_backward_kernel` instead (no dense ``[B, H, L, L]``
probabilities; the reference only for what it does not cover). Gradients flow to ``q``,
``k``, ``v`` and ``lambda_full``; ``paged_attention`` is inference-only.
"""

from __future__ import annotations

import torch

from .attention import OPTIONS_SCHEMA, VARLEN_ATTENTION, resolve_scalars
from .gradients import varlen_attention_backward
from .library import LIBRARY, define_op


def _reference(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal,
               window_left, window_right, softcap, alibi_slopes, scale_softcap):
    scale, softcap = resolve_scalars(scale, softcap, scale_softcap)
    return varlen_attention_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale,
                                     causal, window_left, window_right, softcap, alibi_slopes)


def _fake(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left,
          window_right, softcap, alibi_slopes, scale_softcap):
    dlambda = q.new_empty(0) if lambda_full is None else lambda_full.new_empty(lambda_full.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dlambda


# Returns (dq, dk, dv, dlambda); dlambda is empty [0] for plain attention.
VARLEN_ATTENTION_BACKWARD = define_op(
    "varlen_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
    f"Tensor cu_seqlens_k, {OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)",
    _reference, _fake)


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left, window_right, softcap,
     alibi_slopes, scale_softcap) = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, alibi_slopes, scale_softcap)
    ctx.options = (scale, causal, window_left, window_right, softcap)


def _backward(ctx, grad_out):
    q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, alibi_slopes, scale_softcap = ctx.saved_tensors
    dq, dk, dv, dlambda = VARLEN_ATTENTION_BACKWARD(
        grad_out.contiguous(), q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, *ctx.options,
        alibi_slopes, scale_softcap)
    # One gradient per input of the schema; lambda_full's only when it is a tensor.
    return dq, dk, dv, None, None, (dlambda if lambda_full is not None else None), *(None,) * 7


torch.library.register_autograd(VARLEN_ATTENTION, _backward, setup_context=_setup_context, lib=LIBRARY)
