"""``fused_linear`` on CUDA: a fused GEMV for decode rows, cuBLAS around our kernels above.

A decode step multiplies a few rows by every weight matrix, so it is bound by reading the
weights once. For up to :data:`GEMV_MAX_ROWS` rows, :func:`fused_linear_kernel` gives each
program ``BLOCK_N`` weight rows and the whole ``K`` (one launch, no split-K reduction) and
runs the neighbours of the GEMM inside it:

* prologue: ``RMSNorm`` of each row of ``x`` (Hugging Face ``LlamaRMSNorm``), whose scale
  factors out of the dot products and is applied after them;
* epilogue: ``+ bias``; SwiGLU ``silu(gate) * up`` over the two halves of the weight rows
  (vLLM ``MergedColumnParallelLinear`` + ``SiluAndMul``); ``+ residual``.

Outputs are rounded to the input dtype where the unfused PyTorch code rounds them, except
the normalized input, which stays float32 inside the kernel. More rows run cuBLAS with the
norm and SwiGLU kernels of :mod:`.norm_act_kernel` around it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import reference
from .launch_utils import CachedLauncher, alignments, device_guard, next_power_of_2
from .norm_act_kernel import MAX_NORM_WIDTH, rms_norm
from .norm_act_kernel import silu_and_mul as silu_and_mul_rows

GEMV_MAX_ROWS = 1
"""Row counts up to this run :func:`fused_linear_kernel`; more run cuBLAS. On an H200 the
kernel beats cuBLAS for one row and loses from two (its float32 products grow with the
rows; ``profiling/results/linear.md``)."""


@triton.jit
def fused_linear_kernel(
    x_ptr, w_ptr, bias_ptr, norm_w_ptr, res_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_rm, stride_om, eps,
    HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """Output columns ``[pid * BLOCK_N, +BLOCK_N)`` of all ``M <= BLOCK_M`` rows.

    ``w`` is ``[N, K]`` (``[2N, K]`` with ``SILU_MUL``: gate rows, then up rows), row
    stride ``stride_wn``, unit column stride; ``x`` ``[M, K]``, ``out``/``res`` ``[M, N]``.
    A GEMV: ``[BLOCK_M, BLOCK_N, BLOCK_K]`` products are accumulated elementwise in float32
    and reduced over K once at the end. The RMSNorm scale ``rstd`` of a row is a factor of
    its dot products, so it is applied after the reduction and the norm costs no extra pass.
    """
    dtype = out_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if HAS_NORM:
        sum_sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        if EVEN_K:
            x = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            w = tl.load(w_rows + (k0 + ks)[None, :], mask=col_ok[:, None], other=0.0)
        else:
            x = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            x = x.to(tl.float32)
            w = tl.load(w_rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_NORM:
            sum_sq += x * x
            x = x * tl.load(norm_w_ptr + k0 + ks, mask=k_ok, other=0.0)[None, :].to(tl.float32)
        acc += x[:, None, :] * w[None, :, :].to(tl.float32)
        if SILU_MUL:
            if EVEN_K:
                w_up = tl.load(w_rows + N * stride_wn + (k0 + ks)[None, :], mask=col_ok[:, None], other=0.0)
            else:
                w_up = tl.load(w_rows + N * stride_wn + (k0 + ks)[None, :],
                               mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up += x[:, None, :] * w_up[None, :, :].to(tl.float32)
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if SILU_MUL:
        up = tl.sum(acc_up, axis=2)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / K + tl.cast(eps, tl.float32))[:, None]
        y = y * rstd
        if SILU_MUL:
            up = up * rstd
    if HAS_BIAS:  # added before rounding, as cuBLAS addmm does
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :].to(tl.float32)
        if SILU_MUL:
            up += tl.load(bias_ptr + N + cols, mask=col_ok, other=0.0)[None, :].to(tl.float32)
    y = y.to(dtype)
    if SILU_MUL:
        gate = y.to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        y = (y.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=mask, other=0.0)
        y = (res.to(tl.float32) + y.to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], y, mask=mask)


class LinearTiles(NamedTuple):
    """Launch parameters of :func:`fused_linear_kernel` (from shapes only)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=1024)
def choose_linear_tiles(rows: int, out_features: int, in_features: int, silu_and_mul: bool) -> LinearTiles:
    """Tiles of :func:`fused_linear_kernel`, from the H200 sweep of
    ``profiling/bench_linear.py`` at one row: 2 warps; 4 weight rows a program (8 for
    outputs >= 16384), so >= 4 programs per multiprocessor from 2048 outputs; 1024 columns
    a step, 512 for SwiGLU or wide outputs (as many float32 products in registers). More
    rows take proportionally shorter steps."""
    block_m = next_power_of_2(rows)
    wide = out_features >= 16384
    block_k = 512 if silu_and_mul or wide else 1024
    return LinearTiles(block_m, 8 if wide else 4, max(64, block_k // block_m), num_warps=2, num_stages=1)


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                 residual: torch.Tensor | None = None, silu_and_mul: bool = False,
                 tiles: LinearTiles | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``compiled_attn::fused_linear`` op on CUDA (arguments as its schema, no checks
    here), or on CPU tensors under ``TRITON_INTERPRET=1``; float64 runs the reference.

    Up to ``GEMV_MAX_ROWS`` rows (or with ``tiles``, which overrides the heuristic: tests,
    sweeps) launch :func:`fused_linear_kernel`, writing ``out`` (an optional ``[M, N]``
    output with unit column stride) or a new tensor; more rows run :func:`_cublas_path`
    (``out`` is then ignored). Inputs with a non-unit column stride are copied.
    """
    if x.dtype == torch.float64:  # the kernels accumulate in float32
        return reference.fused_linear(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul)
    rows, in_features = x.shape
    if tiles is None and rows > GEMV_MAX_ROWS:
        return _cublas_path(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul)
    out_features = weight.shape[0] // 2 if silu_and_mul else weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    if out is None:
        out = torch.empty((rows, out_features), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    tiles = tiles or choose_linear_tiles(rows, out_features, in_features, silu_and_mul)
    if tiles.block_m < rows:
        raise ValueError(f"tiles.block_m ({tiles.block_m}) must cover the {rows} rows of x")
    if out.shape != (rows, out_features) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{rows}, {out_features}] with unit column stride, "
                         f"got shape {tuple(out.shape)} strides {out.stride()}")
    dummy = x  # never read when its flag is off
    tensors = (x, weight, dummy if bias is None else bias.contiguous(),
               dummy if norm_weight is None else norm_weight.contiguous(), dummy if residual is None else residual, out)
    ints = (rows, out_features, in_features, x.stride(0), weight.stride(0),
            0 if residual is None else residual.stride(0), out.stride(0))
    flags = (bias is not None, norm_weight is not None, silu_and_mul, residual is not None)
    device_index = x.get_device()
    key = (ints, flags, tiles, x.dtype, device_index, alignments(tensors),
           tuple([t.dtype for t in tensors]))

    def specialize():
        constexprs = dict(HAS_BIAS=flags[0], HAS_NORM=flags[1], SILU_MUL=flags[2], HAS_RESIDUAL=flags[3],
                          BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                          EVEN_K=in_features % tiles.block_k == 0)
        return constexprs, dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)

    with device_guard(x):
        _LAUNCH(key, (triton.cdiv(out_features, tiles.block_n), 1, 1), (*tensors, *ints, norm_eps), device_index,
                specialize)
    return out


_LAUNCH = CachedLauncher(fused_linear_kernel)


def _cublas_path(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul) -> torch.Tensor:
    """RMSNorm kernel, cuBLAS GEMM (``addmm`` folds a residual in), SwiGLU kernel."""
    if norm_weight is not None:
        norm = rms_norm if x.shape[1] <= MAX_NORM_WIDTH else reference.rms_norm
        x = norm(x, norm_weight, norm_eps)
    if silu_and_mul:
        return silu_and_mul_rows(torch.nn.functional.linear(x, weight, bias), residual)
    if residual is not None and bias is None:
        return torch.addmm(residual, x, weight.t()).contiguous()
    y = torch.nn.functional.linear(x, weight, bias)
    return y if residual is None else (residual + y).contiguous()
