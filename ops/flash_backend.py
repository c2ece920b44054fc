"""flash-attn as a backend of the ``varlen_attention`` and ``paged_attention`` ops on CUDA.

When a flash-attn library is importable, the CUDA kernel of ``compiled_attn::varlen_attention``
runs the prefills it covers through it, and so does the CUDA kernel of
``compiled_attn::paged_attention`` with a library that reads a paged cache (flash-attn 4,
see *Paged prefill* below), inside our op (our schema, our fake, so no graph break; the op
stays opaque to ``torch.compile`` then), and everything else through our Triton kernel.
Libraries, in order of preference (``COMPILED_ATTN_FLASH=0`` turns the backend off):

========================  ==================================  ==================================
library                   import                              covers
========================  ==================================  ==================================
flash-attn 4 (CuTe DSL)   ``flash_attn.cute``                 fp16/bf16, head sizes 8-256 (multiples
                                                              of 8), value head size up to 256
flash-attn 3 (Hopper)     ``flash_attn_interface``            the same, value head = head size
flash-attn 2              ``flash_attn``                      the same, value head = head size
========================  ==================================  ==================================

All three take ``softmax_scale``, ``causal`` (bottom-right aligned), ``window_size`` and
``softcap`` with our semantics; ALiBi and per-call scalars as a tensor (``scale_softcap``)
stay on our kernel. Differential attention (interleaved head pairs, Ye et al. 2024) can run
(:data:`FLASH_DIFFERENTIAL`, where our Hopper prefill kernel does not take it) as **two**
flash calls, ``attn(q1, k1, [v1 | v2])`` and ``attn(q2, k2, [v1 | v2])`` with a value head
of ``2 * head_size`` (flash-attn 4, ``head_size <= 128``); the seed's four calls are never
faster than our fused kernel and are not offered. Nothing is copied on the way in:
``q1 = q[:, 0::2]`` (and ``q2``, ``k1``, ``k2``) are strided views that flash-attn 4 takes
as they are (last dim contiguous, 16-byte aligned strides: ``maybe_contiguous`` of its
``cute_dsl_utils``), and since the pair's two value heads lie side by side, ``[v1 | v2]`` is
``v.reshape(Tk, Hkv/2, 2D)``, a view (a copy only if v's heads are not ``D`` apart). The two
outputs ``[T, Hq/2, 2D]`` are combined by one Triton kernel
(:mod:`.triton_kernels.combine_kernel`): ``out1 - lambda * out2`` in float32, cast to q's
dtype, one read of each output and one write, bit-identical to the eager
``(out1.float() - lambda * out2.float()).to(dtype)`` (five kernels with float32
temporaries). flash-attn 4's public ``flash_attn_varlen_func`` takes no ``out=`` buffer, so
each call allocates its own output.

Which one runs follows ``profiling/bench_kernels.py --parts flash``
(``profiling/results/kernels.md``; on the H200, bf16, causal, Hq 32, Hkv 8, D 128,
2026-12-01, back-to-back calls): differential prefill took 1.055 ms as two flash calls inside
the op against 0.958 ms on our fused Hopper prefill kernel at B=8, S=2048 (12.1 ms against
11.1 ms for 64 sequences of 128-4096 tokens), flash-attn 4 alone 1.563 ms with a
concatenated ``[v1 | v2]`` and an eager combine, 1.764 ms as the seed's four calls, and
0.987 ms for its two calls with no combine at all. So the calls our varlen launcher routes
to that kernel (``triton_kernels.attention.prefill_kernel_takes``: head size 128 on an sm90
GPU) stay ours (:func:`hopper_takes`; the launcher now runs them on the Gluon kernel's fused
schedule, ``attention.GLUON_DIFFERENTIAL``: 0.854 ms against flash-attn 4's two calls' 0.967 on
2026-12-02), and the others, timed on neither side, take the two calls
(:data:`FLASH_DIFFERENTIAL`). Plain prefill: flash-attn 4 (0.551 ms through the op against
0.548 ms for flash-attn 4 alone and 0.758 ms on our Hopper prefill kernel, 2026-12-01), except
the batches of many short causal sequences on which our Gluon kernel measured faster
(:func:`gluon_faster`, 2026-12-02). Calls under :data:`MIN_QUERY_TOKENS` query tokens stay on
our kernel (flash-attn 4's host time per call). :func:`disabled` turns the backend off for a block of
code (the benchmark's TTFT rows with and without flash-attn).

*Paged prefill.* flash-attn 4's ``flash_attn_varlen_func`` reads our paged cache as it is:
``page_table=block_table`` (int32 ``[B, max_blocks]``), ``seqused_k=seq_lens`` and
``cu_seqlens_q``, no ``cu_seqlens_k``, caches ``[num_blocks, block_size, Hkv, D]``;
sequence ``b`` has ``seq_lens[b]`` keys and its causal mask is bottom-right aligned on
them (query ``i`` sees keys up to ``seq_lens[b] - q_len + i``: its ``seqlen_k`` is
``seqused_k[b]``), as in our op. :func:`paged_attention` sends it the calls
:func:`covers_paged` takes, decided from shapes alone (no device read, so a CUDA graph
can capture either path): plain attention over a float16/bfloat16 cache of a block size in
:data:`PAGED_BLOCK_SIZES`, head sizes as :func:`plan`, no ALiBi, no ``scale_softcap``, and
only calls that carry a prefill chunk, ``T > B`` (more queries than sequences: chunked
prefill, prefix-cache hits, mixed batches, multi-token decode) of at least
:data:`MIN_QUERY_TOKENS` query tokens. A decode step (``T == B``,
one query per sequence, padded CUDA-graph batches included) stays on our kernel, which
reads the cache 2-11% faster than flash-attn 4's paged decode; differential attention
(our fused kernel reads each K/V block once) and fp8 caches (``k_scale``/``v_scale``) stay
on ours too. Block sizes are 16 and 32 (:data:`PAGED_BLOCK_SIZES`: flash-attn 4 loads a
block as long as its key tile whole, and NaN past ``seq_lens`` in a last block would reach
the output). flash-attn 2 and 3 take no page table in their varlen function
(``FlashLibrary.takes_page_table``): paged calls stay on ours with them. Paged prefill
through flash-attn 4 took 0.545 ms against 1.170 ms on our kernel (8 chunks of 512 tokens
after 4096 cached keys, block 16; flash-attn 4 alone 0.546 ms, 2026-11-30); our Gluon prefill
kernel now takes them in 0.529 ms, and keeps the causal chunks of head size 128 of at most
3072 tokens a sequence on average (:func:`gluon_faster_paged`, 2026-12-02 and 12-03).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from typing import Callable, Iterator, NamedTuple

import torch
from torch import Tensor

from .attention import default_scale

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton kernels run on CPU tensors (its interpreter): :func:`combine` takes the kernel there too."""

FLASH_DIFFERENTIAL = True
"""Whether covered differential prefills run as two flash calls (else our fused kernel),
except those our Hopper prefill kernel takes (:func:`hopper_takes`: measured faster there,
see the module docstring)."""

MIN_QUERY_TOKENS = 4096
"""Calls with fewer query tokens (``q.shape[0]``) stay on our kernel. flash-attn 4 spends
host time on each call (its CuTe DSL launch path), which a model's forward hides behind the
other layers' work only when there are enough tokens: on the H200 (2026-11-30) the 1.1 B
model's 2048-token prefill took 32.8 ms with the backend against 17.6 ms without (32 flash
calls, two per differential layer: about 0.5 ms each; not profiled), while op-level calls
of 4096 (paged, after 4096 cached keys) and 16384 query tokens ran 2.1x and 1.5x faster
through it, and the model's 8192-token prefill took 52.3 ms with the backend against 74.8 ms
without (TTFT of a new engine's first request, 2026-11-30). Sizes between 2048 and 4096 are
not measured."""


class FlashLibrary(NamedTuple):
    """An importable flash-attn and what it accepts."""

    name: str
    varlen: Callable  # its flash_attn_varlen_func
    max_value_head_size: int  # largest value head size (head size of v may differ from q/k's up to this)
    needs_max_seqlen: bool  # takes max_seqlen_q / max_seqlen_k as required host ints
    none_for_unbounded: bool  # window_size uses None, not -1, for an unbounded side
    takes_page_table: bool  # varlen reads a paged cache (page_table=, seqused_k=, no cu_seqlens_k)


def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a broken install (missing CUDA libraries) is no backend
        return None


@functools.cache
def find_library() -> FlashLibrary | None:
    """The first importable flash-attn of the module docstring's table, or ``None`` (also
    when ``COMPILED_ATTN_FLASH=0``)."""
    if os.environ.get("COMPILED_ATTN_FLASH", "1") == "0":
        return None
    if (module := _import("flash_attn.cute")) is not None and hasattr(module, "flash_attn_varlen_func"):
        return FlashLibrary("flash-attn 4", module.flash_attn_varlen_func, 256, False, True, True)
    if (module := _import("flash_attn_interface")) is not None and hasattr(module, "flash_attn_varlen_func"):
        return FlashLibrary("flash-attn 3", module.flash_attn_varlen_func, 0, True, False, False)
    if (module := _import("flash_attn")) is not None and hasattr(module, "flash_attn_varlen_func"):
        return FlashLibrary("flash-attn 2", module.flash_attn_varlen_func, 0, True, False, False)
    return None


def plan(library: FlashLibrary, q: Tensor, lambda_full: Tensor | None, alibi_slopes: Tensor | None,
         scale_softcap: Tensor | None) -> str | None:
    """``"plain"`` or ``"differential"`` (two calls) when ``library`` runs this varlen call
    (``q`` ``[T, Hq, D]``; shapes and options only, no values), else ``None``."""
    head_size = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or head_size % 8 or not 8 <= head_size <= 256:
        return None
    if alibi_slopes is not None or scale_softcap is not None:
        return None
    if lambda_full is None:
        return "plain"
    return "differential" if FLASH_DIFFERENTIAL and 2 * head_size <= library.max_value_head_size else None


def _window(library: FlashLibrary, window_left: int, window_right: int) -> tuple:
    """Our ``(left, right)`` window (``-1`` unbounded) as ``library``'s ``window_size``."""
    if library.none_for_unbounded:
        return (None if window_left < 0 else window_left, None if window_right < 0 else window_right)
    return (window_left, window_right)


def _call(library: FlashLibrary, q, k, v, scale, causal, window_left, window_right, softcap, **layout) -> Tensor:
    """``library.varlen(q, k, v, **layout)`` with our options mapped to its arguments (scale
    ``None``: ``head_size ** -0.5``); its output without the lse. ``layout`` says where the
    sequences are (``cu_seqlens_q``/``cu_seqlens_k``, or a page table)."""
    out = library.varlen(q, k, v, softmax_scale=default_scale(scale, q.shape[-1]), causal=causal,
                         window_size=_window(library, window_left, window_right), softcap=softcap, **layout)
    return out[0] if isinstance(out, tuple) else out


def _max_seqlen(cu_seqlens: Tensor, total: int) -> int:
    """The longest sequence (one device-to-host read), or ``total`` (a bound) while a CUDA
    graph is being captured."""
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return total
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def run(library: FlashLibrary, formulation: str, q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal,
        window_left, window_right, softcap) -> Tensor:
    """The varlen op's result through ``library`` (see :func:`plan`): ``[T, Hq, D]``, or
    ``[T, Hq/2, 2D]`` for ``"differential"``, q's dtype."""
    layout = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if library.needs_max_seqlen:
        layout.update(max_seqlen_q=_max_seqlen(cu_seqlens_q, q.shape[0]),
                      max_seqlen_k=_max_seqlen(cu_seqlens_k, k.shape[0]))
    options = (scale, causal, window_left, window_right, softcap)
    if formulation == "plain":
        return _call(library, q, k, v, *options, **layout)
    # [Tk, Hkv/2, 2D]: [v1 | v2] per KV pair, heads 2j and 2j+1 side by side: a view of v
    # (a copy only if v's heads are not D apart)
    values = v.reshape(v.shape[0], v.shape[1] // 2, 2 * v.shape[2])
    out1 = _call(library, q[:, 0::2], k[:, 0::2], values, *options, **layout)
    out2 = _call(library, q[:, 1::2], k[:, 1::2], values, *options, **layout)
    return combine(out1, out2, lambda_full, q.dtype)


def combine(out1: Tensor, out2: Tensor, lambda_full: Tensor, dtype: torch.dtype) -> Tensor:
    """``(out1.float() - lambda * out2.float()).to(dtype)`` with ``lambda_full`` ``[]`` or
    ``[Hq/2]`` per pair: one Triton kernel on CUDA tensors (and on CPU tensors under
    ``TRITON_INTERPRET=1``), bit-identical to this eager expression, which runs otherwise."""
    if out1.is_cuda or _INTERPRETED:
        from .triton_kernels.combine_kernel import combine_pairs

        return combine_pairs(out1, out2, lambda_full, dtype)
    lam = lambda_full.float().reshape(1, -1, 1)  # [] or [Hq/2] -> per pair
    return (out1.float() - lam * out2.float()).to(dtype)


_DISABLED = 0  # depth of nested disabled() blocks


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, the backend takes no call: ``varlen_attention`` and
    ``paged_attention`` run on our Triton kernels as with ``COMPILED_ATTN_FLASH=0``, for
    comparisons in one process (the benchmark's prefill/TTFT rows with and without
    flash-attn). The switch is one integer read on the host when an op's CUDA kernel (or
    ``torch.compile``, deciding whether the op stays opaque) asks :func:`covers` or
    :func:`covers_paged`; it is not a guard: a graph compiled with static shapes
    inside the block has our kernel traced in and keeps it, and a captured CUDA graph keeps
    the kernels it captured. Nests; process-wide (not per thread)."""
    global _DISABLED
    _DISABLED += 1
    try:
        yield
    finally:
        _DISABLED -= 1


def _formulation(q, k, v, lambda_full, alibi_slopes, scale_softcap) -> str | None:
    """The :func:`plan` of the installed library for a call on ``q``, ``k``, ``v``, or ``None``
    (inside :func:`disabled`, no library, not CUDA, fewer than :data:`MIN_QUERY_TOKENS` query
    tokens (never none), not covered, or a differential call our Hopper prefill kernel takes:
    :func:`hopper_takes`)."""
    if _DISABLED:
        return None
    library = find_library()
    if library is None or not q.is_cuda or q.shape[0] < max(MIN_QUERY_TOKENS, 1):
        return None
    formulation = plan(library, q, lambda_full, alibi_slopes, scale_softcap)
    if formulation == "differential" and hopper_takes(q, k, v, lambda_full):
        return None
    return formulation


def hopper_takes(q: Tensor, k: Tensor, v: Tensor, lambda_full: Tensor) -> bool:
    """Whether :func:`_formulation` leaves this differential call to our varlen launcher:
    one our Hopper prefill kernel covers (``triton_kernels.attention.prefill_kernel_takes``:
    its head sizes, on an sm90 GPU). The launcher runs it on the Gluon kernel's fused
    schedule where that covers it, else on the Hopper kernel; both took such calls faster
    than flash-attn 4's two calls on the H200 (the module docstring)."""
    from .triton_kernels.attention import prefill_kernel_takes

    return prefill_kernel_takes(q, k, v, lambda_full, None)


GLUON_MIN_SEQUENCES = 8
"""Plain varlen calls of fewer sequences go to the library (see :func:`gluon_faster`)."""
GLUON_MAX_MEAN_QUERY = 3072
"""Plain calls of more query tokens a sequence (on average) go to the library (2048 until
2026-12-03, when the 64 sequences of 128-4096 tokens, 2219 on average, measured faster on
ours: :func:`gluon_faster`)."""


def _gluon_shaped(q: Tensor, sequences: int, causal: bool, window_left: int, window_right: int) -> bool:
    """Causal with no window, head size 128, at most :data:`GLUON_MAX_MEAN_QUERY` query
    tokens a sequence on average (``q`` ``[T, Hq, D]``): the calls where our Gluon kernel
    measured at least level with flash-attn 4."""
    return (causal and window_left < 0 and window_right < 0 and q.shape[-1] == 128
            and q.shape[0] <= GLUON_MAX_MEAN_QUERY * sequences)


def gluon_faster(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale, causal: bool,
                 window_left: int, window_right: int, softcap: float) -> bool:
    """Whether a plain varlen call stays on our Gluon prefill kernel though the library
    covers it: :func:`_gluon_shaped`, at least :data:`GLUON_MIN_SEQUENCES` sequences
    (``cu_seqlens_q.shape[0] - 1``), a call the Gluon kernel covers
    (``triton_kernels.attention.gluon_takes_varlen``). Shapes only, so a skewed batch (seven
    sequences of 128 tokens and one of 15000) counts by its mean, though flash-attn 4 ran a
    single long sequence faster.

    ``profiling/bench_kernels.py --parts routing``, H200, 2026-12-02, bf16, Hq 32, Hkv 8, the op
    with flash-attn 4 against the op on our kernels, queued calls, ms, two runs (the second
    at the final default tiles):

    * ours level or faster: B=8 S=1024 0.201 / 0.197 against 0.209 / 0.211; B=8 S=2048 0.565 /
      0.552 against 0.571 / 0.552; B=16 S=1024 0.347 / 0.331 against 0.353 / 0.332; B=32
      S=512 0.250 / 0.233 against 0.255 / 0.231; B=64 S=256 0.204 / 0.201 against 0.213 /
      0.198; 16 sequences of 128-1024 tokens 0.213 / 0.211 against 0.234 / 0.219;
    * flash-attn 4 faster: B=1 S=16384 3.90 / 3.63 against 3.58 / 3.50; B=4 S=4096 1.03 /
      1.05 against 1.00 / 0.99; B=8 S=4096 2.01 / 2.07 against 2.01 / 2.02; 64 sequences of
      128-4096 tokens 6.78 / 6.70 against 6.59 / 6.49; non-causal B=8 S=2048 0.964 / 0.959
      against 0.936 / 0.929; head size 64 0.393 / 0.396 against 0.356 / 0.352;
    * level, left to flash-attn 4: B=1 S=8192, B=2 S=4096, B=4 S=2048.

    A third run (2026-12-03, lazy rescaling in our plain kernel; queued, then one eager
    call, ms, flash-attn 4 against ours): 64 sequences of 128-4096 tokens 6.58 / 6.64 against
    6.34 / 6.60 (so the mean bound rose to 3072), B=8 S=2048 0.564 / 0.565 against 0.542 /
    0.523, B=8 S=4096 2.05 / 1.95 against 2.05 / 2.02, B=4 S=4096 1.02 / 0.98 against 1.04 /
    1.03, B=1 S=16384 3.60 / 3.46 against 3.78 / 3.62. Calls of 0.2-0.4 ms read noisier in
    that run (ours queued B=8 S=1024 0.220, B=32 S=512 0.304, against 0.197 and 0.233 in the
    runs before; 16 sequences 0.268 against flash-attn 4's 0.411): left as they were.

    A fourth (2026-12-03, 26th session, first thing on a fresh machine): B=8 S=3072 1.207 /
    1.187 against 1.169 / 1.171 (inside the 3072 bound), B=8 S=2048 0.573 / 0.600 against
    0.548 / 0.539, 64 sequences 6.59 / 6.63 against 6.37 / 6.63; B=8 S=4096 1.98 / 1.97
    against 2.07 / 2.10. The small calls swung the other way again (16 sequences 0.318 /
    0.329 against 0.394 / 0.432, B=32 S=512 0.254 / 0.258 against 0.238 / 0.192): they are
    host-bound (``profiling/bench_host.py``: 242 us of host time a call on the Gluon route
    against 120 us for flash-attn 4's), so their ratio follows the machine's host."""
    from .triton_kernels.attention import gluon_takes_varlen

    sequences = cu_seqlens_q.shape[0] - 1
    return (sequences >= GLUON_MIN_SEQUENCES and _gluon_shaped(q, sequences, causal, window_left, window_right)
            and gluon_takes_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, None, scale, causal, window_left,
                                   window_right, softcap))


def gluon_faster_paged(query: Tensor, key_cache: Tensor, value_cache: Tensor, cu_seqlens_q: Tensor,
                       seq_lens: Tensor, block_table: Tensor, scale, causal: bool, window_left: int,
                       window_right: int, softcap: float) -> bool:
    """Whether a plain paged prefill stays on our Gluon kernel though flash-attn 4 covers it:
    :func:`_gluon_shaped` over ``seq_lens.shape[0]`` sequences and a call the Gluon kernel
    takes (``triton_kernels.attention.gluon_takes_paged``: at least 128 query tokens a
    sequence on average). Shapes only. The second run of :func:`gluon_faster`'s (H200, block
    16 unless said, ms, ours against flash-attn 4): 8 chunks of 512 after 4096 cached keys
    0.540 against 0.549 (block 32: 0.523 against 0.545), one of 2048 after 8192 0.548 against
    0.556, 32 of 128 after 2048 0.283 against 0.304; 4 of 4096 with no prefix 1.095 against
    1.065 (over the mean bound: flash-attn 4's). The fourth run (2026-12-03, queued): 4 chunks
    of 3072 after 1024 (inside the 3072 bound) 0.963 against 1.025, the 8 of 512 0.524 against
    0.554, 4 of 4096 with no prefix 1.077 against 1.066."""
    from .triton_kernels.attention import gluon_takes_paged

    return (_gluon_shaped(query, seq_lens.shape[0], causal, window_left, window_right)
            and gluon_takes_paged(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, None, scale,
                                  causal, window_left, window_right, softcap))


def _varlen_formulation(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left, window_right,
                        softcap, alibi_slopes, scale_softcap) -> str | None:
    """:func:`_formulation`, but ``None`` for a plain call :func:`gluon_faster` keeps from
    flash-attn 4 (the library it was measured against; flash-attn 3 and 2 keep every plain
    call they cover)."""
    formulation = _formulation(q, k, v, lambda_full, alibi_slopes, scale_softcap)
    if formulation == "plain" and find_library().name == "flash-attn 4" and gluon_faster(
            q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window_left, window_right, softcap):
        return None
    return formulation


def covers(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left, window_right, softcap,
           alibi_slopes, scale_softcap) -> bool:
    """Whether the CUDA kernel of ``varlen_attention`` runs these schema arguments through
    flash-attn (CUDA tensors, a library, a :func:`plan`, not one :func:`gluon_faster` keeps)."""
    return _varlen_formulation(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left,
                               window_right, softcap, alibi_slopes, scale_softcap) is not None


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full=None, scale=None, causal=True,
                     window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, scale_softcap=None) -> Tensor:
    """The ``compiled_attn::varlen_attention`` op on CUDA: flash-attn where it
    :func:`covers` the call, our Triton kernel otherwise (arguments as the op's schema)."""
    from .triton_kernels import varlen_attention as triton_varlen

    formulation = _varlen_formulation(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left,
                                      window_right, softcap, alibi_slopes, scale_softcap)
    if formulation is None:
        return triton_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left,
                             window_right, softcap, alibi_slopes, scale_softcap)
    return run(find_library(), formulation, q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal,
               window_left, window_right, softcap)


# --- paged prefill ---------------------------------------------------------------------------

PAGED_BLOCK_SIZES = frozenset({16, 32})
"""Cache block sizes whose ``paged_attention`` prefills run on flash-attn 4. Its paged loader
takes any page size (its own tests run 1, 4 and 128; on the H200 16 to 256 ran), but a page
as long as its key tile (64 to 144 on Hopper, 64 or 128 on Blackwell; 128 at head size 128)
is loaded whole by TMA, the rows past ``seq_lens[b]`` of a sequence's last block included,
and a NaN there turns the output into NaN (``P = 0`` times ``NaN``; its
``flash_attn_varlen_func`` docstring). Our op reads nothing past ``seq_lens[b]``, so a cache
may hold anything there (the GPU tests fill it with NaN); below 64 flash-attn 4 always loads
row by row (``cp.async``), only rows below ``seq_lens[b]``, and keeps that promise."""


def _paged_library(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full, scale, causal,
                   window_left, window_right, softcap, alibi_slopes, scale_softcap, k_scale,
                   v_scale) -> FlashLibrary | None:
    """The library that runs this ``paged_attention`` call (the op's schema arguments), or
    ``None`` (our kernel): shapes, dtypes and which options are given, never a tensor's
    values."""
    # One query per sequence or fewer (T <= B: every decode step, padded CUDA-graph batches
    # included) stays on our kernel, which reads the cache 2-11% faster than flash-attn 4's
    # paged decode; more queries than sequences (T > B) means some prefill chunk.
    if query.shape[0] <= seq_lens.shape[0]:
        return None
    if lambda_full is not None or k_scale is not None or v_scale is not None:
        return None  # differential paged attention stays on our fused kernel; fp8 caches too
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        return None
    if key_cache.shape[1] not in PAGED_BLOCK_SIZES:
        return None
    # disabled, no library, not CUDA, ...
    if _formulation(query, key_cache, value_cache, None, alibi_slopes, scale_softcap) != "plain":
        return None
    library = find_library()
    if not library.takes_page_table or gluon_faster_paged(query, key_cache, value_cache, cu_seqlens_q, seq_lens,
                                                          block_table, scale, causal, window_left, window_right,
                                                          softcap):
        return None
    return library


def covers_paged(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full, scale, causal,
                 window_left, window_right, softcap, alibi_slopes, scale_softcap, k_scale=None,
                 v_scale=None) -> bool:
    """Whether the CUDA kernel of ``paged_attention`` runs these schema arguments through
    flash-attn 4 (the ``opaque`` predicate of its traced kernel): a prefill-bearing call
    (more queries than sequences) of plain attention over a float16/bfloat16 cache of a
    block size in :data:`PAGED_BLOCK_SIZES`, without ALiBi or traced scalars, CUDA tensors, a
    library that takes a page table, outside :func:`disabled`, not one
    :func:`gluon_faster_paged` keeps on our kernel."""
    return _paged_library(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full, scale,
                          causal, window_left, window_right, softcap, alibi_slopes, scale_softcap, k_scale,
                          v_scale) is not None


def run_paged(library: FlashLibrary, query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, scale,
              causal, window_left, window_right, softcap) -> Tensor:
    """Plain paged attention through ``library`` (``takes_page_table``): ``[T, Hq, D]``,
    query's dtype. Sequence ``b``'s keys are ``0 .. seq_lens[b]-1`` of its blocks
    (``seqused_k``, no ``cu_seqlens_k``), causal masking bottom-right aligned on them as in
    our op. No host read: flash-attn 4 bounds the keys by ``block_table``'s width and the
    queries by ``T`` and reads the lengths on the device."""
    return _call(library, query, key_cache, value_cache, scale, causal, window_left, window_right, softcap,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=None, seqused_k=seq_lens, page_table=block_table)


def paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full=None,
                    scale=None, causal=True, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                    scale_softcap=None, k_scale=None, v_scale=None) -> Tensor:
    """The ``compiled_attn::paged_attention`` op on CUDA: flash-attn 4 where it
    :func:`covers_paged` the call (prefill-bearing plain attention), our Triton kernel
    otherwise (decode, differential, fp8 caches, ...; arguments as the op's schema)."""
    library = _paged_library(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full, scale,
                             causal, window_left, window_right, softcap, alibi_slopes, scale_softcap, k_scale, v_scale)
    if library is None:
        from .triton_kernels import paged_attention as triton_paged

        return triton_paged(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full, scale,
                            causal, window_left, window_right, softcap, alibi_slopes, scale_softcap, k_scale,
                            v_scale)
    return run_paged(library, query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, scale, causal,
                     window_left, window_right, softcap)
