"""Explicit gradients of the varlen attention ops and of ``fused_linear``, in plain tensor ops.

The backward kernels of :mod:`compiled_attn.ops.attention_backward` and
:mod:`compiled_attn.ops.linear` used ``torch.func.vjp`` of the reference, which fails under
any ``TorchDispatchMode`` (``FlopCounterMode``, debug modes, activation-checkpoint policies:
"Cannot access storage of TensorWrapper") and under ``torch.library.opcheck``. The functions
here write the gradients out: no ``torch.func``, no autograd inside, only ordinary tensor ops,
so they run unchanged under any dispatch mode, on any device, and as the kernel of a custom
op. They import nothing from the project (only ``torch``).

* :func:`varlen_attention_backward`: gradients of
  :func:`compiled_attn.ops.reference.varlen_attention` (plain and differential).
* :func:`fused_linear_backward`: gradients of :func:`compiled_attn.ops.reference.fused_linear`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["fused_linear_backward", "varlen_attention_backward"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- attention ------------------------------------------------------------------------------


def _padded_index(cu_seqlens: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """Gather index ``[B, max_len]`` of a packed batch and its validity mask.

    Position ``i`` of sequence ``b`` is token ``cu_seqlens[b] + i`` when ``i`` is below the
    sequence's length; padded positions point at token 0 (any valid row: their values are
    masked out and their gradients never scattered back).
    """
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens.diff().long()
    pos = torch.arange(max_len, device=cu_seqlens.device)
    valid = pos < lengths[:, None]
    return torch.where(valid, starts[:, None] + pos, 0), valid


def varlen_attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    lambda_full: Tensor | None, scale: float, causal: bool, window_left: int, window_right: int,
    softcap: float, alibi_slopes: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`compiled_attn.ops.reference.varlen_attention` (``flash_attn_varlen_func``
    semantics), plain (``lambda_full is None``) or differential.

    The math is the FlashAttention-2 backward (Dao 2023, arXiv 2307.08691, Algorithm 2),
    recomputing the probabilities from ``q`` and ``k`` (no saved output or logsumexp):

    * ``s = scale * q kᵀ``; with ``softcap > 0``, ``S = softcap * tanh(s / softcap)``, else
      ``S = s``; ALiBi adds ``-slope * |p - j|`` (a constant: no gradient); masked entries
      get ``-inf`` and ``P = softmax(S)``; a row that sees no key has ``P = 0`` (zero output,
      zero gradient);
    * ``dV = Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P ∘ (dP - rowsum(P ∘ dP))`` (FA2's
      ``rowsum(dO ∘ O)``, computed as ``rowsum(P ∘ dP)``, the same number without ``O``);
    * softcap chain rule ``ds = dS ∘ (1 - tanh²(s / softcap))``; ``dQ = scale * ds K``,
      ``dK = scale * dsᵀ Q``; GQA sums ``dK``/``dV`` over the query heads of a group.

    Differential attention (Ye et al. 2024, arXiv 2410.05258, eq. 1; interleaved head pairs
    as in :func:`compiled_attn.ops.reference.varlen_attention`) is
    ``O = A1 [v1, v2] - λ A2 [v1, v2]``: two softmax components per pair with weights
    ``w = (1, -λ)``, both reading the concatenated values. Then ``dP_c = w_c dO [v1, v2]ᵀ``,
    ``d[v1, v2] = (A1 - λ A2)ᵀ dO`` and ``dλ = -Σ dO ∘ (A2 [v1, v2]) = -Σ A2 ∘ (dO [v1, v2]ᵀ)``,
    summed per pair for a ``[Hq // 2]`` ``λ`` and over everything for a 0-d one.

    Plain attention is the same computation with one component of weight 1, so both share one
    code path: sequences are gathered into a zero-padded batch ``[B, max_len, ...]`` (one host
    sync reads the two maximum lengths), every step is one batched einsum over
    ``[B, Hkv(-pairs), group, component, max_q, max_k]`` with a per-sequence visibility mask,
    and the gradients are scattered back to the packed tokens. Memory is
    ``O(B * Hq * max_q * max_k)``.

    Args:
        grad_out: ``[Tq, Hq, D]`` (plain) or ``[Tq, Hq // 2, 2 * D]`` (differential), any
            float dtype.
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]``; ``Hq % Hkv == 0`` (query head ``h`` reads
            KV head ``h // (Hq // Hkv)``; differential: query pair ``j`` reads KV pair
            ``j // (Hq // Hkv)``, both head counts even). float16/bfloat16/float32/float64.
        cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` int, cumulative lengths from 0. Tokens past
            ``cu_seqlens[-1]`` get zero gradients (the forward leaves their output zero).
        lambda_full: ``None`` (plain) or a float tensor of shape ``[]``, ``[1]`` or
            ``[Hq // 2]``.
        scale, causal, window_left, window_right, softcap: as the forward (bottom-right
            aligned causal mask, ``-1`` = unbounded window side, ``softcap <= 0`` = off).
        alibi_slopes: ``[Hq]`` float or ``None`` (constant, no gradient).

    Returns:
        ``(dq, dk, dv, dlambda)``: ``dq`` like ``q``, ``dk`` like ``k``, ``dv`` like ``v`` (shape
        and dtype), new tensors. ``dlambda`` has ``lambda_full``'s shape and dtype, or is
        ``q.new_empty(0)`` for plain attention. Arithmetic is float32 (float64 for float64
        inputs) throughout.
    """
    differential = lambda_full is not None
    dtype = _compute_dtype(q.dtype)
    num_q_tokens, num_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs <= 0 or num_q_tokens == 0:  # no query: every gradient is zero
        dlambda = q.new_empty(0) if lambda_full is None else torch.zeros_like(lambda_full)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dlambda

    lengths_q, lengths_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    max_q, max_k = (int(n) for n in torch.stack([lengths_q.max(), lengths_k.max()]).tolist())
    index_q, valid_q = _padded_index(cu_seqlens_q, max_q)  # [B, Lq]
    index_k, valid_k = _padded_index(cu_seqlens_k, max_k)  # [B, Lk]

    # One layout for both variants: heads -> (kv head or kv pair h, group g, component c).
    #   plain:        C = 1, weights w = 1,        values [B, Lk, Hkv, D]
    #   differential: C = 2, weights w = (1, -λ),  values [B, Lk, Hkv // 2, 2D] = [v1, v2]
    num_components = 2 if differential else 1
    num_kv_groups = num_kv_heads // num_components
    batch = (num_seqs,)
    qg = q[index_q].to(dtype).reshape(*batch, max_q, num_kv_groups, group, num_components, head_size)
    kg = k[index_k].to(dtype).reshape(*batch, max_k, num_kv_groups, num_components, head_size)
    vg = v[index_k].to(dtype).reshape(*batch, max_k, num_kv_groups, num_components * v.shape[-1])
    dout = grad_out[index_q].to(dtype).reshape(*batch, max_q, num_kv_groups, group, vg.shape[-1])
    if differential:
        lam = lambda_full.to(dtype).reshape(-1).expand(num_heads // 2).reshape(num_kv_groups, group)
        weights = torch.stack([torch.ones_like(lam), -lam], dim=-1)  # [h, g, c]
    else:
        weights = torch.ones(num_kv_groups, group, 1, dtype=dtype, device=q.device)

    # Visibility of key j to query i of sequence b (bottom-right aligned), [B, 1, 1, 1, Lq, Lk].
    pos_q = torch.arange(max_q, device=q.device)
    pos_k = torch.arange(max_k, device=q.device)
    offset = (lengths_k - lengths_q).long()  # query i sits at key position i + k_len - q_len
    distance = pos_q[None, :, None] + offset[:, None, None] - pos_k[None, None, :]  # [B, Lq, Lk]
    visible = valid_q[:, :, None] & valid_k[:, None, :]
    if causal:
        visible &= distance >= 0
    if window_left >= 0:
        visible &= distance <= window_left
    if window_right >= 0:
        visible &= distance >= -window_right
    visible = visible[:, None, None, None]
    distance = distance[:, None, None, None]

    # Forward recomputation: probabilities [B, h, g, c, Lq, Lk].
    scores = torch.einsum("bihgcd,bjhcd->bhgcij", qg, kg) * scale
    if softcap > 0:
        tanh = torch.tanh(scores / softcap)
        scores = softcap * tanh
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).reshape(num_kv_groups, group, num_components)
        scores = scores - slopes[..., None, None] * distance.abs().to(dtype)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    probs = torch.where(visible.any(dim=-1, keepdim=True), probs, 0.0)  # no key -> 0 (not NaN)

    # Backward (FA2 Algorithm 2, lines 11-20, for every component at once).
    dout_v = torch.einsum("bihge,bjhe->bhgij", dout, vg)  # dO Vᵀ, shared by the components
    dprobs = weights[..., None, None] * dout_v[:, :, :, None]
    dscores = probs * (dprobs - (probs * dprobs).sum(dim=-1, keepdim=True))
    if softcap > 0:
        dscores = dscores * (1 - tanh * tanh)
    dscores = dscores * scale
    dq = torch.einsum("bhgcij,bjhcd->bihgcd", dscores, kg)
    dk = torch.einsum("bhgcij,bihgcd->bjhcd", dscores, qg)
    dv = torch.einsum("bhgcij,bihge->bjhe", probs * weights[..., None, None], dout)

    dq_packed = q.new_zeros(q.shape, dtype=dtype)
    dk_packed = k.new_zeros(k.shape, dtype=dtype)
    dv_packed = v.new_zeros(v.shape, dtype=dtype)
    dq_packed[index_q[valid_q]] = dq.reshape(*batch, max_q, num_heads, head_size)[valid_q]
    dk_packed[index_k[valid_k]] = dk.reshape(*batch, max_k, num_kv_heads, head_size)[valid_k]
    dv_packed[index_k[valid_k]] = dv.reshape(*batch, max_k, num_kv_heads, v.shape[-1])[valid_k]

    if differential:
        # dλ_j = -Σ dO ∘ (A2 V) = -Σ_{b,i,j} A2 ∘ (dO Vᵀ), per pair (h, g).
        dlambda = -(probs[:, :, :, 1] * dout_v).sum(dim=(0, 3, 4)).reshape(-1)
        if lambda_full.numel() == 1:
            dlambda = dlambda.sum()
        dlambda = dlambda.reshape(lambda_full.shape).to(lambda_full.dtype)
    else:
        dlambda = q.new_empty(0)
    return dq_packed.to(q.dtype), dk_packed.to(k.dtype), dv_packed.to(v.dtype), dlambda


# --- fused_linear -------------------------------------------------------------------------------

#: positions of ``(x, weight, bias, norm_weight, residual)`` in the ``fused_linear`` op schema
#: ``(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul)``.
_SCHEMA_TENSOR_ARGS = (0, 1, 2, 3, 5)


def fused_linear_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor | None,
    norm_eps: float, residual: Tensor | None, silu_and_mul: bool,
    needs_input_grad: Sequence[bool] = (True,) * 5,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of :func:`compiled_attn.ops.reference.fused_linear`:
    ``out = residual + act(F.linear(rms_norm(x), weight, bias))``, each part optional.

    Forward, as the reference computes it (``n`` = ``x``'s dtype, ``f`` = float32, or float64
    for float64 inputs):

    * ``rms_norm`` (Zhang & Sennrich 2019, arXiv 1910.07467; Hugging Face ``LlamaRMSNorm``):
      ``r = rsqrt(mean(x_f²) + eps)``, ``x̂ = x_f r``, ``xn = norm_weight * x̂.to(n)``;
    * ``y = xn Wᵀ + b``;
    * ``silu_and_mul`` (SwiGLU, Shazeer 2020, arXiv 2002.05202): ``y = silu(g) * u`` with
      ``g, u = y.chunk(2, -1)``;
    * ``out = residual + y``.

    Backward (the casts are identities for the gradient): ``d_residual = dO``;
    ``du = dO silu(g)``, ``dg = dO u σ(g) (1 + g (1 - σ(g)))``; ``db = Σ_t dy``,
    ``dW = dyᵀ xn``, ``dxn = dy W``; ``d_norm_weight = Σ_t dxn ∘ x̂.to(n)`` and
    ``dx = r (dx̂ - x̂ mean(dx̂ ∘ x̂))`` with ``dx̂ = dxn ∘ norm_weight``. Pointwise parts and
    reductions are computed in float32 (float64 stays); the two GEMMs run in ``x``'s dtype
    (accumulating in float32), as autograd of ``F.linear`` does, so no float32 copy of the
    weight is made.

    Args:
        grad_out: ``[T, out]`` gradient of the output (``out = weight.shape[0]``, or half of
            it with ``silu_and_mul``).
        x: ``[T, in]``; weight: ``[out or 2 * out, in]``; bias: ``[weight.shape[0]]`` or
            ``None``; norm_weight: ``[in]`` or ``None``; residual: ``[T, out]`` or ``None``;
            all in one float dtype (float16/bfloat16/float32/float64).
        norm_eps: RMSNorm epsilon (unused without ``norm_weight``).
        silu_and_mul: whether the forward applied SwiGLU to the two output halves.
        needs_input_grad: which gradients to compute, either 5 flags for
            ``(x, weight, bias, norm_weight, residual)`` or the op's 7 flags
            (``ctx.needs_input_grad`` of the ``fused_linear`` op, whose non-tensor entries
            ``norm_eps`` and ``silu_and_mul`` are ignored). Default: all.

    Returns:
        ``(dx, dweight, dbias, dnorm_weight, dresidual)``, each in its input's shape and dtype,
        or ``None`` where the input is ``None`` or its flag is false. ``dresidual`` is
        ``grad_out`` itself (cast to the residual's dtype if it differs), as autograd of an
        addition returns it.
    """
    flags = tuple(bool(f) for f in needs_input_grad)
    if len(flags) == 7:
        flags = tuple(flags[i] for i in _SCHEMA_TENSOR_ARGS)
    if len(flags) != 5:
        raise ValueError(f"needs_input_grad must have 5 or 7 entries, got {len(flags)}")
    need_x, need_w, need_b, need_nw, need_r = (
        flag and t is not None for flag, t in zip(flags, (x, weight, bias, norm_weight, residual)))

    dresidual = grad_out.to(residual.dtype) if need_r else None
    if not (need_x or need_w or need_b or need_nw):
        return None, None, None, None, dresidual

    dtype = _compute_dtype(x.dtype)
    # Forward recomputation, rounding as the reference does.
    if norm_weight is not None:
        x_f = x.to(dtype)
        rstd = torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + norm_eps)
        x_hat = x_f * rstd
        x_hat_n = x_hat.to(x.dtype)
        x_in = norm_weight * x_hat_n
    else:
        x_in = x

    grad_f = grad_out.to(dtype)
    if silu_and_mul:
        y = torch.nn.functional.linear(x_in, weight, bias)
        gate, up = y.to(dtype).chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        d_up = grad_f * gate * sig
        d_gate = grad_f * up * sig * (1 + gate * (1 - sig))
        dy = torch.cat([d_gate, d_up], dim=-1)
    else:
        dy = grad_f

    dbias = dy.sum(0).to(bias.dtype) if need_b else None
    dy_n = dy.to(x.dtype)
    dweight = (dy_n.transpose(0, 1) @ x_in).to(weight.dtype) if need_w else None
    if not (need_x or need_nw):
        return None, dweight, dbias, None, dresidual

    dx_in = (dy_n @ weight).to(dtype)
    if norm_weight is None:
        return dx_in.to(x.dtype), dweight, dbias, None, dresidual
    dnorm_weight = (dx_in * x_hat_n.to(dtype)).sum(0).to(norm_weight.dtype) if need_nw else None
    dx = None
    if need_x:
        dx_hat = dx_in * norm_weight.to(dtype)
        dx = (rstd * (dx_hat - x_hat * (dx_hat * x_hat).mean(-1, keepdim=True))).to(x.dtype)
    return dx, dweight, dbias, dnorm_weight, dresidual
