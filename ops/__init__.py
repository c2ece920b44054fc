"""``compiled_attn.ops``: the project's ``torch.library`` custom ops.

Importing this package registers, in the ``compiled_attn`` namespace:

==============================  ============================================================
op                              semantics
==============================  ============================================================
``reshape_and_cache``           write k/v into the paged cache (slot -1 skipped)
``paged_attention``             queries vs. paged cache (prefill/decode/mixed), flash-attn
``differential_paged_attention``  fused differential attention over the paged cache
``varlen_attention``            ``flash_attn_varlen_func`` over contiguous k/v
``differential_varlen_attention``  fused differential attention over contiguous k/v
``copy_blocks`` / ``swap_blocks``  block copy-on-write / GPU<->CPU swap
``varlen_attention_backward``   gradients of both varlen ops (they support autograd)
``fused_linear``                RMSNorm + linear + SwiGLU + residual (Triton for decode rows)
==============================  ============================================================

Call them through the functions exported here (defaults, eager validation) or as
``torch.ops.compiled_attn.<name>``.
"""

from . import attention_backward  # noqa: F401  (autograd of the varlen ops)
from .attention import paged_attention, varlen_attention
from .cache import PAD_SLOT_ID, copy_blocks, reshape_and_cache, swap_blocks
from .linear import fused_linear
from . import backends  # noqa: F401  (registers the Triton CUDA kernels when available)

__all__ = [
    "PAD_SLOT_ID",
    "copy_blocks",
    "fused_linear",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
    "varlen_attention",
]
