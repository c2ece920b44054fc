"""RMSNorm and SwiGLU kernels around a cuBLAS GEMM: ``fused_linear`` for many rows.

Above :data:`~.linear_kernel.GEMV_MAX_ROWS` rows a GEMM is no longer a weight read and
cuBLAS is the fastest; these two kernels are what runs before and after it (one program
per row, or per row and column block). Rounding as Hugging Face Llama: RMSNorm statistics
in float32, cast, times the weight in the input dtype; ``silu(gate)`` rounded, times ``up``
rounded; a residual added last.
"""

import torch
import triton
import triton.language as tl

from .launch_utils import CachedLauncher, alignments, device_guard, next_power_of_2

MAX_NORM_WIDTH = 1 << 16  # one program holds a whole row
SILU_BLOCK = 1024


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, K, stride_xm, stride_om, eps, BLOCK_K: tl.constexpr):
    """``out[m] = w * (x[m] * rsqrt(mean(x[m]^2) + eps))`` for row ``m = pid``."""
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    mask = ks < K
    x = tl.load(x_ptr + row * stride_xm + ks, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + tl.cast(eps, tl.float32))  # Inductor may pass float64
    y = (x * rstd).to(dtype).to(tl.float32) * tl.load(w_ptr + ks, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + ks, y.to(dtype), mask=mask)


@triton.jit
def silu_and_mul_kernel(y_ptr, res_ptr, out_ptr, N, stride_ym, stride_rm, stride_om,
                        HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out[m, n] = silu(y[m, n]) * y[m, N + n] (+ res[m, n])``, row ``pid0``, columns block ``pid1``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    gate = tl.load(y_ptr + row * stride_ym + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    up = tl.load(y_ptr + row * stride_ym + N + cols, mask=mask, other=0.0).to(tl.float32)
    gate = gate.to(tl.float32)
    out = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    if HAS_RESIDUAL:
        out = tl.load(res_ptr + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32) + out.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, out.to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` ``[M, K]`` (``K <= MAX_NORM_WIDTH``; a non-unit column
    stride is copied) with ``weight`` ``[K]``; a new ``[M, K]`` tensor."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    rows, width = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows:
        tensors = (x, weight, out)
        device_index = x.get_device()
        key = (width, x.stride(0), x.dtype, weight.dtype, device_index, alignments(tensors))
        with device_guard(x):
            _RMS_NORM(key, (rows, 1, 1), (*tensors, width, x.stride(0), out.stride(0), eps), device_index,
                      lambda: (dict(BLOCK_K=next_power_of_2(width)), dict(num_warps=8)))
    return out


def silu_and_mul(y: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(y[:, :N]) * y[:, N:]`` (``+ residual`` ``[M, N]``) for ``y`` ``[M, 2N]``; inputs
    with a non-unit column stride are copied."""
    y = y if y.stride(-1) == 1 else y.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    rows, width = y.shape
    half = width // 2
    out = torch.empty((rows, half), dtype=y.dtype, device=y.device)
    if rows:
        tensors = (y, y if residual is None else residual, out)
        strides = (y.stride(0), 0 if residual is None else residual.stride(0), out.stride(0))
        device_index = y.get_device()
        key = (half, strides, residual is None, y.dtype, tensors[1].dtype, device_index,
               alignments(tensors))
        with device_guard(y):
            _SILU_AND_MUL(key, (rows, triton.cdiv(half, SILU_BLOCK), 1), (*tensors, half, *strides), device_index,
                          lambda: (dict(HAS_RESIDUAL=residual is not None, BLOCK_N=SILU_BLOCK), {}))
    return out


_RMS_NORM = CachedLauncher(rms_norm_kernel)
_SILU_AND_MUL = CachedLauncher(silu_and_mul_kernel)
