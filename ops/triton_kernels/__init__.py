"""Triton kernels of the ``compiled_attn`` ops (the CUDA implementations).

=============================  =======================================================================
module                         idea
=============================  =======================================================================
``attention_kernel``           one unified kernel: paged or contiguous K/V, plain or fused differential,
                               any mix of prefill/decode rows, GQA groups sharing K/V loads, split-KV
``merge_kernel``               merge of split-KV (flash-decoding) partials by log-sum-exp
``combine_kernel``             ``out1 - lambda * out2`` of the flash-attn backend's two differential calls
``attention_backward_kernel``  ``varlen_attention_backward``: FlashAttention-2 backward (plain and
                               differential; a dQ kernel with the softmax statistics, a dK/dV kernel;
                               no atomics) and its launcher
``cache_kernel``               ``reshape_and_cache`` (slot -1 skipped)
``linear_kernel``              ``fused_linear``: a GEMV with RMSNorm / bias / SwiGLU / residual fused
                               (decode rows), cuBLAS with the kernels below for more rows
``norm_act_kernel``            RMSNorm and SwiGLU (+ residual) row kernels
``config``                     tile sizes and split count from tensor shapes only (CUDA-graph safe)
``prefill_kernel``             Hopper prefill for varlen q/k/v, contiguous or paged (plain and fused
                               differential): TMA descriptor loads, 128-row tiles, causal tile
                               skipping with unmasked interior tiles, reversed tile order
``prefill``                    its tiles and launchers: ``varlen_prefill`` / ``covers``
                               (``attention.PREFILL_KERNEL`` routes to it) and ``paged_prefill`` /
                               ``covers_paged`` (``attention.PAGED_PREFILL_KERNEL``)
``gluon_prefill_kernel``       warp-specialized prefill (Gluon, sm90): a TMA producer warpgroup and two
                               consumer warpgroups, persistent; plain varlen and paged
``gluon_prefill``              its launchers and ``covers`` (``attention.GLUON_PREFILL`` routes to it)
``attention``                  host launchers ``paged_attention`` / ``varlen_attention``
``launch_utils``               small host helpers (powers of two, device guard, SM count)
=============================  =======================================================================

:func:`compiled_variants` counts the kernel variants Triton has compiled so far (what
``Engine.warmup`` keeps out of requests).

:mod:`compiled_attn.ops.backends` registers these launchers as the ``cuda`` kernels of the
custom ops. They can also be called directly, on CPU tensors too when ``TRITON_INTERPRET=1``
is set before Triton is imported (the interpreter tests do so).
"""

import sys

from .attention import paged_attention, varlen_attention
from .attention_backward_kernel import (attention_backward_dkdv_kernel, attention_backward_dq_kernel,
                                        varlen_attention_backward)
from .attention_kernel import attention_kernel
from .cache_kernel import reshape_and_cache, reshape_and_cache_kernel
from .combine_kernel import combine_pairs_kernel
from .launch_utils import traced_launches
from .linear_kernel import fused_linear, fused_linear_kernel
from .merge_kernel import merge_splits_kernel
from .norm_act_kernel import rms_norm_kernel, silu_and_mul_kernel
from .prefill import varlen_prefill
from .prefill_kernel import prefill_kernel

KERNELS = (attention_kernel, merge_splits_kernel, reshape_and_cache_kernel, fused_linear_kernel,
           rms_norm_kernel, silu_and_mul_kernel, attention_backward_dq_kernel, attention_backward_dkdv_kernel,
           combine_pairs_kernel, prefill_kernel)


def compiled_variants() -> int:
    """Variants of our Triton kernels compiled (or loaded from Triton's disk cache) in this
    process so far, summed over Triton's in-memory kernel caches (0 under the interpreter).
    A count that grows during a request means the request waited for a JIT compile."""
    kernels = KERNELS
    if (gluon := sys.modules.get(f"{__name__}.gluon_prefill_kernel")) is not None:  # loaded at its first launch
        kernels += (gluon.gluon_prefill_kernel,)
    return sum(len(caches[0]) for kernel in kernels for caches in getattr(kernel, "device_caches", {}).values())


__all__ = ["compiled_variants", "fused_linear", "paged_attention", "reshape_and_cache", "traced_launches",
           "varlen_attention", "varlen_attention_backward", "varlen_prefill"]
