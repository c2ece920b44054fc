"""``compiled_attn.ops``: the project's ``torch.library`` ops.

Importing this package registers, in the ``compiled_attn`` namespace (see :mod:`.library`
for how: straight to the dispatcher, a fake for tracing, the reference on every device,
Triton kernels on CUDA):

=============================  ============================================================
op                             semantics
=============================  ============================================================
``reshape_and_cache``          write k/v into the paged cache (slot -1 skipped); an fp8
                               (float8_e4m3fn) cache stores ``x / k_scale``, ``x / v_scale``
``paged_attention``            queries vs. paged cache (prefill/decode/mixed), flash-attn
                               ``flash_attn_with_kvcache``; differential with ``lambda_full``;
                               reads an fp8 cache as ``cache * k_scale``, ``cache * v_scale``
``varlen_attention``           ``flash_attn_varlen_func`` over contiguous k/v; differential
                               with ``lambda_full``; has a backward
``varlen_attention_backward``  its gradients
``copy_blocks`` / ``swap_blocks``  block copy-on-write / GPU<->CPU swap
``fused_linear``               RMSNorm + linear + SwiGLU + residual (Triton for decode rows)
=============================  ============================================================

Call them through the functions exported here (defaults, eager checks; set
``COMPILED_ATTN_CHECK_VALUES=0`` to skip the checks that read metadata values) or as
``torch.ops.compiled_attn.<name>`` (no checks, the shortest path to the kernel).
"""

from . import attention_backward  # noqa: F401  (autograd of varlen_attention)
from .attention import paged_attention, varlen_attention
from .cache import PAD_SLOT_ID, copy_blocks, reshape_and_cache, swap_blocks
from .linear import fused_linear
from . import flops  # noqa: F401  (FLOP formulas for torch.utils.flop_counter)
from . import backends  # noqa: F401  (binds the Triton CUDA kernels when available)

__all__ = [
    "PAD_SLOT_ID",
    "copy_blocks",
    "fused_linear",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
    "varlen_attention",
]
