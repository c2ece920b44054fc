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
==============================  ============================================================

Call them through the functions exported here (defaults, eager validation) or as
``torch.ops.compiled_attn.<name>``.
"""

from .attention import paged_attention, varlen_attention
from .cache import PAD_SLOT_ID, copy_blocks, reshape_and_cache, swap_blocks

__all__ = [
    "PAD_SLOT_ID",
    "copy_blocks",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
    "varlen_attention",
]
