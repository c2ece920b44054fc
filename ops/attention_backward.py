"""Gradients of the varlen attention ops (training and fine-tuning over packed batches).

``varlen_attention`` and ``differential_varlen_attention`` get an autograd formula that
calls one more custom op, ``compiled_attn::varlen_attention_backward``, so the backward
is as opaque to ``torch.compile`` as the forward (its fake gives the gradient shapes).
Its kernel differentiates the reference (:mod:`compiled_attn.ops.reference`) with
``torch.func.vjp``: exact, simple and slow, recomputing the forward. Gradients flow
to ``q``, ``k``, ``v`` and ``lambda_full``; the paged ops are inference-only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from .attention import differential_varlen_attention_op, varlen_attention_op


@torch.library.custom_op("compiled_attn::varlen_attention_backward", mutates_args=())
def varlen_attention_backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    lambda_full: Tensor | None, scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, alibi_slopes: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(dq, dk, dv, dlambda)``; ``dlambda`` is empty ``[0]`` for plain attention."""
    options = (scale, causal, window_left, window_right, softcap, alibi_slopes)

    def forward(q, k, v, *lam):
        return reference.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *(lam or (None,)), *options)

    # torch.func.vjp works inside an op kernel, where plain autograd is switched off.
    primals = (q, k, v) if lambda_full is None else (q, k, v, lambda_full)
    _, vjp = torch.func.vjp(forward, *primals)
    grads = vjp(grad_out)
    dlambda = grads[3] if lambda_full is not None else q.new_empty(0)
    return grads[0], grads[1], grads[2], dlambda


@varlen_attention_backward_op.register_fake
def _(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left,
      window_right, softcap, alibi_slopes):
    dlambda = q.new_empty(0) if lambda_full is None else lambda_full.new_empty(lambda_full.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dlambda


def _setup_context(ctx, inputs, output) -> None:
    differential = len(inputs) == 12
    q, k, v, cu_seqlens_q, cu_seqlens_k = inputs[:5]
    lambda_full = inputs[5] if differential else None
    scale, causal, window_left, window_right, softcap, alibi_slopes = inputs[-6:]
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, alibi_slopes)
    ctx.options = (scale, causal, window_left, window_right, softcap)
    ctx.differential = differential


def _backward(ctx, grad_out):
    q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, alibi_slopes = ctx.saved_tensors
    dq, dk, dv, dlambda = varlen_attention_backward_op(
        grad_out.contiguous(), q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, *ctx.options, alibi_slopes,
    )
    no_grad_tail = (None,) * 6  # scale, causal, window_left, window_right, softcap, alibi_slopes
    if ctx.differential:
        return dq, dk, dv, None, None, dlambda, *no_grad_tail
    return dq, dk, dv, None, None, *no_grad_tail


varlen_attention_op.register_autograd(_backward, setup_context=_setup_context)
differential_varlen_attention_op.register_autograd(_backward, setup_context=_setup_context)
