"""One-pass combine of the two flash-attn calls of a differential prefill.

The two-call formulation of :mod:`compiled_attn.ops.flash_backend` leaves ``out1`` and
``out2`` ``[T, Hq/2, 2D]`` (the query's dtype, one per component of each head pair) and
needs ``(out1.float() - lambda * out2.float()).to(dtype)`` with ``lambda_full`` ``[]`` or
``[Hq/2]``. Eager PyTorch runs that as five kernels with float32 temporaries; here it is one
read of each input and one write: per element, both loaded and widened to float32, ``lam *
o2`` rounded to float32, subtracted from ``o1`` (rounded to float32), and cast to the
output dtype (round to nearest even; to bfloat16 by integer arithmetic, see
:func:`_to_bfloat16_rtne`). Fused multiply-add contraction is turned off
(``enable_fp_fusion=False``), so the result is bit-identical to the eager expression.

The grid is ``(T, cdiv(Hq/2, BLOCK_H))``, from shapes only (safe inside a captured CUDA
graph; nothing is read on the host). Each program writes a ``[BLOCK_H, 2D]`` tile of one
token, ``2D`` padded to a power of two (masked), ``BLOCK_H * pad(2D) <= 4096`` elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch_utils import CachedLauncher, alignments, device_guard, next_power_of_2

TILE_ELEMENTS = 4096
"""Elements of one program's tile (heads x padded value width)."""


@triton.jit
def _to_bfloat16_rtne(x):
    """float32 ``x`` rounded to bfloat16, nearest even, by integer arithmetic on its bits (as
    PyTorch's ``c10::round_to_nearest_even``; NaN becomes ``0x7FC0``). The same bits as the
    GPU's ``cvt.rn.bf16.f32`` for every non-NaN value, and also under Triton's interpreter,
    whose own float32 -> bfloat16 cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def combine_pairs_kernel(
    out_ptr, o1_ptr, o2_ptr, lambda_ptr, num_pairs,
    stride_1t, stride_1h, stride_2t, stride_2h, stride_ot, stride_oh, stride_l,
    VALUE_SIZE: tl.constexpr, VALUE_SIZE_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out[t, h] = (o1[t, h] - lambda[h] * o2[t, h])`` in float32, cast to ``out``'s dtype;
    program ``(t, hb)`` covers pairs ``hb * BLOCK_H ...`` of token ``t``.

    Args:
        out_ptr: ``[T, num_pairs, VALUE_SIZE]`` (last dim contiguous).
        o1_ptr, o2_ptr: ``[T, num_pairs, VALUE_SIZE]`` (last dim contiguous), any dtype.
        lambda_ptr: ``lambda[h]`` at ``lambda_ptr + h * stride_l`` (``stride_l = 0``: one
            scalar for every pair), any float dtype.
    """
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, VALUE_SIZE_PAD)
    head_ok = heads < num_pairs
    mask = head_ok[:, None] & (dims < VALUE_SIZE)[None, :]
    o1 = tl.load(o1_ptr + token * stride_1t + heads[:, None] * stride_1h + dims[None, :], mask=mask, other=0.0)
    o2 = tl.load(o2_ptr + token * stride_2t + heads[:, None] * stride_2h + dims[None, :], mask=mask, other=0.0)
    lam = tl.load(lambda_ptr + heads * stride_l, mask=head_ok, other=0.0).to(tl.float32)
    out = o1.to(tl.float32) - lam[:, None] * o2.to(tl.float32)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        result = _to_bfloat16_rtne(out)
    else:
        result = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :], result, mask=mask)


def _block_heads(num_pairs: int, value_pad: int) -> int:
    return max(1, min(next_power_of_2(num_pairs), TILE_ELEMENTS // value_pad))


def combine_pairs(out1: torch.Tensor, out2: torch.Tensor, lambda_full: torch.Tensor, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``(out1.float() - lambda_full.float().reshape(1, -1, 1) * out2.float()).to(dtype)`` in
    one kernel (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``).

    Args:
        out1, out2: ``[T, P, V]`` of one shape, any strides on the first two axes, last axis
            contiguous (else copied).
        lambda_full: ``[]``, ``[1]`` or ``[P]``, any float dtype.
        dtype: the result's dtype.
        out: optional ``[T, P, V]`` of ``dtype`` (last axis contiguous) to write into.

    Returns:
        ``out``, or a new contiguous ``[T, P, V]`` tensor of ``dtype``.
    """
    if out1.shape != out2.shape or out1.dim() != 3:
        raise ValueError(f"combine_pairs: out1 {tuple(out1.shape)} and out2 {tuple(out2.shape)} must be one [T, P, V]")
    if not out1.device == out2.device == lambda_full.device:
        raise ValueError(f"combine_pairs: out1 on {out1.device}, out2 on {out2.device}, lambda_full on "
                         f"{lambda_full.device}: one device")
    out1 = out1 if out1.stride(-1) == 1 else out1.contiguous()
    out2 = out2 if out2.stride(-1) == 1 else out2.contiguous()
    tokens, pairs, width = out1.shape
    if lambda_full.numel() not in (1, pairs):
        raise ValueError(f"combine_pairs: lambda_full of {lambda_full.numel()} elements for {pairs} pairs")
    lam = lambda_full.reshape(-1)
    if out is None:
        out = torch.empty(out1.shape, dtype=dtype, device=out1.device)
    elif out.shape != out1.shape or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"combine_pairs: out {tuple(out.shape)} {out.dtype} must be {tuple(out1.shape)} {dtype}, "
                         "last axis contiguous")
    if tokens == 0 or pairs == 0 or width == 0:
        return out
    value_pad = next_power_of_2(width)
    block_heads = _block_heads(pairs, value_pad)
    stride_l = lam.stride(0) if lam.numel() > 1 else 0
    strides = (out1.stride(0), out1.stride(1), out2.stride(0), out2.stride(1), out.stride(0), out.stride(1), stride_l)
    tensors = (out, out1, out2, lam)
    device_index = out1.get_device()
    key = (pairs, width, strides, out.dtype, out1.dtype, out2.dtype, lam.dtype, device_index, alignments(tensors))
    grid = (tokens, triton.cdiv(pairs, block_heads), 1)
    with device_guard(out1):
        _COMBINE(key, grid, (*tensors, pairs, *strides), device_index,
                 lambda: (dict(VALUE_SIZE=width, VALUE_SIZE_PAD=value_pad, BLOCK_H=block_heads),
                          dict(num_warps=4, enable_fp_fusion=False)))
    return out


_COMBINE = CachedLauncher(combine_pairs_kernel)
