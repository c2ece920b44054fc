"""CUDA kernels of the ``compiled_attn`` ops, bound when Triton is importable.

Each op keeps one contract (schema, fake, reference kernel on every device; see
:mod:`.library`) and gets its ``CUDA`` kernel here: a launcher of
:mod:`compiled_attn.ops.triton_kernels` that takes the schema's arguments as they are, so a
call goes from the dispatcher straight to the launcher. ``varlen_attention`` runs through
flash-attn where a flash-attn library is importable and covers the call, and so do the
prefill-bearing calls of ``paged_attention`` that flash-attn 4's page table covers
(:mod:`.flash_backend`); our Triton kernels run everything else. CPU tensors keep the
reference.

Under ``torch.compile``, the attention ops and ``fused_linear`` on CUDA tensors of static
shapes are traced *through* their launcher, as ``torch.library.triton_op`` does
(:func:`.library.register_traced_kernel`): the graph then holds the Triton kernels
themselves (``wrap_triton``), launch plans are decided once at compile time, and Inductor
launches the kernels from its generated code, without a dispatcher call or our Python
launcher per call. With symbolic shapes (a dynamic batch, as :class:`compiled_attn.Engine`
compiles), or a varlen or paged call that flash-attn or the Gluon prefill kernel
(``triton_kernels.gluon_prefill``) covers, the op stays opaque: its fake gives shapes and
the kernel picks a plan per call from the real shapes. ``reshape_and_cache``
stays opaque: it writes the KV cache in place, which a traced kernel would have to
functionalize (a copy of the cache). Under ``TRITON_INTERPRET=1`` nothing is traced through
(fake tensors cannot reach the interpreter), so the interpreter tests call the launchers
directly.

``varlen_attention_backward`` runs the FlashAttention-2 backward of
:mod:`.triton_kernels.attention_backward_kernel` on CUDA (its launcher falls back to the
reference of :mod:`.gradients` for what it does not cover, see its ``covers``); it stays
opaque under ``torch.compile`` (its grid comes from shapes only, so it can be captured in a
CUDA graph). ``copy_blocks`` and ``swap_blocks`` keep the reference on every device:
device-side indexing with exact gather-then-scatter semantics (a one-pass in-place copy
would race when a destination block is also a source), off the per-step path.
"""

from __future__ import annotations

import importlib.util

from .attention import PAGED_ATTENTION, VARLEN_ATTENTION
from .attention_backward import VARLEN_ATTENTION_BACKWARD
from .cache import RESHAPE_AND_CACHE
from .library import register_kernel, register_traced_kernel
from .linear import FUSED_LINEAR

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None

if TRITON_AVAILABLE:
    from . import flash_backend, triton_kernels
    from .triton_kernels import compiled_variants
    from .triton_kernels.attention import gluon_takes_paged, gluon_takes_varlen

    register_kernel(PAGED_ATTENTION, "CUDA", flash_backend.paged_attention)  # flash-attn 4 for prefill it covers
    register_kernel(VARLEN_ATTENTION, "CUDA", flash_backend.varlen_attention)  # flash-attn where it covers
    register_kernel(VARLEN_ATTENTION_BACKWARD, "CUDA", triton_kernels.varlen_attention_backward)
    register_kernel(RESHAPE_AND_CACHE, "CUDA", triton_kernels.reshape_and_cache)
    register_kernel(FUSED_LINEAR, "CUDA", triton_kernels.fused_linear)
    # opaque: the calls flash-attn or our Gluon prefill kernel run (neither traces into Inductor's code)
    register_traced_kernel(PAGED_ATTENTION, triton_kernels.paged_attention, triton_kernels.traced_launches,
                           opaque=lambda *args: flash_backend.covers_paged(*args) or gluon_takes_paged(*args))
    register_traced_kernel(VARLEN_ATTENTION, triton_kernels.varlen_attention, triton_kernels.traced_launches,
                           opaque=lambda *args: flash_backend.covers(*args) or gluon_takes_varlen(*args))
    register_traced_kernel(FUSED_LINEAR, triton_kernels.fused_linear, triton_kernels.traced_launches)
else:
    def compiled_variants() -> int:
        """No Triton, no compiled kernel variants (see ``triton_kernels.compiled_variants``)."""
        return 0
