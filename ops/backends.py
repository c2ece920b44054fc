"""CUDA kernels of the ``compiled_attn`` ops, bound when Triton is importable.

Each op keeps one contract (schema, fake, reference kernel on every device; see
:mod:`.library`) and gets its ``CUDA`` kernel here: a launcher of
:mod:`compiled_attn.ops.triton_kernels` that takes the schema's arguments as they are, so a
call goes from the dispatcher straight to the launcher. Eager calls, ``torch.compile`` (the
op stays opaque, its fake gives shapes) and CUDA-graph capture all see the same op; CPU
tensors keep the reference. A ``triton_op`` would let Inductor see the Triton kernels, but
with CPU tensors under ``TRITON_INTERPRET=1`` it fails inside ``torch.compile`` (fake
tensors reach the interpreter), so the interpreter tests call the launchers directly.

``copy_blocks``, ``swap_blocks`` and the varlen backward keep the reference on every device:
the first two are device-side indexing with exact gather-then-scatter semantics (a one-pass
in-place copy would race when a destination block is also a source) and off the per-step
path; the backward is the explicit formula of :mod:`.gradients`.
"""

from __future__ import annotations

import importlib.util

from .attention import PAGED_ATTENTION, VARLEN_ATTENTION
from .cache import RESHAPE_AND_CACHE
from .library import register_kernel, register_traced_kernel
from .linear import FUSED_LINEAR

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None

if TRITON_AVAILABLE:
    from . import triton_kernels
    from .triton_kernels import compiled_variants

    register_kernel(PAGED_ATTENTION, "CUDA", triton_kernels.paged_attention)
    register_kernel(VARLEN_ATTENTION, "CUDA", triton_kernels.varlen_attention)
    register_kernel(RESHAPE_AND_CACHE, "CUDA", triton_kernels.reshape_and_cache)
    register_kernel(FUSED_LINEAR, "CUDA", triton_kernels.fused_linear)
    for op, launcher in ((PAGED_ATTENTION, triton_kernels.paged_attention),
                         (VARLEN_ATTENTION, triton_kernels.varlen_attention),
                         (FUSED_LINEAR, triton_kernels.fused_linear)):
        register_traced_kernel(op, launcher, triton_kernels.traced_launches)
else:
    def compiled_variants() -> int:
        """No Triton, no compiled kernel variants (see ``triton_kernels.compiled_variants``)."""
        return 0
