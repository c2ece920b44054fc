"""Attention ops: paged and varlen, each plain or differential (an optional ``lambda_full``).

Two ops in the ``compiled_attn`` namespace, defined directly on the dispatcher
(:mod:`.library`): a fake implementation gives shapes to tracing, the plain-PyTorch
reference of :mod:`.reference` is the kernel on every device, and the Triton launchers take
over on CUDA (:mod:`.backends`). Schema tails, shared by both ops::

    Tensor? lambda_full, float scale, bool causal, SymInt window_left, SymInt window_right,
    float softcap, Tensor? alibi_slopes, Tensor? scale_softcap

``paged_attention`` ends with ``Tensor? k_scale=None, Tensor? v_scale=None``: the
dequantization scales of a float8_e4m3fn KV cache (vLLM's fp8 KV cache).

``scale_softcap`` (float32 ``[2]``) carries ``(scale, softcap)`` as tensor values, which then
replace the two float arguments (a softcap of 0 still turns capping off). Under
``torch.compile`` a float argument that changes between calls would specialize the graph
on each value (Dynamo cannot keep a float symbolic once it reaches an op's ``float``), so
the public functions pass a given ``scale`` or ``softcap`` this way while tracing; eager
calls, calls that leave both at their defaults, and layers whose options are constants,
pass floats.

The public functions fill in defaults (``scale = head_size ** -0.5``) and, called eagerly,
check their arguments before any kernel runs (types, shapes and dtypes on the host; metadata
values with one device-to-host read, see :mod:`.value_checks`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from .library import LIBRARY, define_op
from .validation import check_call_options, check_paged_args, check_scalars, check_varlen_args
from .value_checks import check_kv_scale_values, check_paged_values, check_varlen_values, should_check

Window = tuple[int, int]

OPTIONS_SCHEMA = ("Tensor? lambda_full, float scale, bool causal, SymInt window_left, "
                  "SymInt window_right, float softcap, Tensor? alibi_slopes, Tensor? scale_softcap")


def output_shape(query: Tensor, differential: bool) -> tuple[int, int, int]:
    """``[T, Hq, D]`` (plain) or ``[T, Hq/2, 2D]`` (differential) for ``query`` ``[T, Hq, D]``."""
    num_tokens, num_heads, head_size = query.shape
    return (num_tokens, num_heads // 2, 2 * head_size) if differential else (num_tokens, num_heads, head_size)


def output_buffer(query: Tensor, differential: bool, out: Tensor | None) -> Tensor:
    """``out``, checked to be an :func:`output_shape` tensor of query's dtype with a
    contiguous last dim, or a new one when ``None`` (the Triton launchers' ``out=``).

    Raises:
        ValueError: ``out`` of another shape or dtype, or a strided last dim.
    """
    shape = output_shape(query, differential)
    if out is None:
        return query.new_empty(shape)
    if tuple(out.shape) != shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {shape} {query.dtype} with a contiguous last dim, "
                         f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    return out


def default_scale(scale: float | None, head_size: int) -> float:
    """``scale``, or flash-attn's default softmax scale ``head_size ** -0.5`` when ``None``."""
    return head_size ** -0.5 if scale is None else scale


def resolve_scalars(scale: float, softcap: float, scale_softcap: Tensor | None):
    """``(scale, softcap)`` as floats: the arguments, or the values ``scale_softcap`` carries."""
    return (scale, softcap) if scale_softcap is None else tuple(scale_softcap.tolist())


def _paged_reference(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full,
                     scale, causal, window_left, window_right, softcap, alibi_slopes, scale_softcap,
                     k_scale=None, v_scale=None):
    scale, softcap = resolve_scalars(scale, softcap, scale_softcap)
    return reference.paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table,
                                     lambda_full, scale, causal, window_left, window_right, softcap, alibi_slopes,
                                     k_scale, v_scale)


def _paged_fake(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full,
                scale, causal, window_left, window_right, softcap, alibi_slopes, scale_softcap,
                k_scale=None, v_scale=None):
    check_paged_args(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full,
                     window_left, window_right, softcap, alibi_slopes, scale_softcap, k_scale, v_scale)
    return query.new_empty(output_shape(query, lambda_full is not None))  # kernels return contiguous


PAGED_ATTENTION = define_op(
    "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor cu_seqlens_q, "
    f"Tensor seq_lens, Tensor block_table, {OPTIONS_SCHEMA}, Tensor? k_scale=None, "
    "Tensor? v_scale=None) -> Tensor",
    _paged_reference, _paged_fake)


def _varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left,
                      window_right, softcap, alibi_slopes, scale_softcap):
    scale, softcap = resolve_scalars(scale, softcap, scale_softcap)
    return reference.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal,
                                      window_left, window_right, softcap, alibi_slopes)


def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left,
                 window_right, softcap, alibi_slopes, scale_softcap):
    check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, window_left, window_right,
                      softcap, alibi_slopes, scale_softcap)
    return q.new_empty(output_shape(q, lambda_full is not None))


VARLEN_ATTENTION = define_op(
    "varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    f"{OPTIONS_SCHEMA}) -> Tensor",
    _varlen_reference, _varlen_fake)


def _paged_setup_context(ctx, inputs, output) -> None:
    pass


def _paged_backward(ctx, grad_out):
    raise NotImplementedError(
        "paged_attention has no backward (it reads a KV cache, for inference); for gradients "
        "use compiled_attn.ops.varlen_attention over contiguous k/v")


torch.library.register_autograd(PAGED_ATTENTION, _paged_backward, setup_context=_paged_setup_context, lib=LIBRARY)


# --- public API ----------------------------------------------------------------------------


def _options(scale: float | None, window_size: Window, softcap: float | None, causal: bool):
    """``(window_left, window_right, softcap, given)``: the options' types checked
    (``check_call_options``), ``softcap`` ``None`` as 0, and whether the caller gave
    ``scale`` or ``softcap`` (see :func:`_scalars`)."""
    window_left, window_right = check_call_options(scale, window_size, softcap, causal)
    return window_left, window_right, 0.0 if softcap is None else softcap, scale is not None or softcap is not None


def _scalars(query: Tensor, scale: float | None, softcap: float, given: bool) -> tuple[float, float, Tensor | None]:
    """The op's ``scale``, ``softcap`` and ``scale_softcap`` arguments: the floats (default
    scale ``head_size ** -0.5``; values checked when eager) when eager or when the caller
    left both at their defaults (not ``given``), or, for values given while tracing, the
    ``scale_softcap`` tensor, so that a float that changes between calls stays symbolic
    (Dynamo shows a symbolic float to Python as a plain ``float``: only the defaults are
    known constants). Its values are then checked when the graph runs
    (``torch._assert_async``: a ``RuntimeError`` on the CPU, a device-side assert on CUDA),
    never by a Python comparison, which would specialize the graph on the value. (Floats
    also let the flash-attn backend take a call: it needs them on the host.)"""
    scale = default_scale(scale, query.shape[-1])
    if torch.compiler.is_compiling() and not given:
        # Defaults are valid by construction; no Python check while tracing (a symbolic head
        # size makes the default scale a symbolic float, which the op's float then specializes).
        return scale, softcap, None
    if torch.compiler.is_compiling():
        one = query.new_ones((), dtype=torch.float32)
        scalars = torch.stack((one * scale, one * softcap))
        torch._assert_async(torch.isfinite(scalars).all() & (scalars[0] > 0) & (scalars[1] >= 0),
                            "scale must be finite and > 0 and softcap finite and >= 0")
        return 1.0, 0.0, scalars
    check_scalars(scale, softcap)
    return scale, softcap, None


def paged_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, cu_seqlens_q: Tensor,
    seq_lens: Tensor, block_table: Tensor, lambda_full: Tensor | None = None, *,
    scale: float | None = None, causal: bool = True, window_size: Window = (-1, -1),
    softcap: float | None = None, alibi_slopes: Tensor | None = None, k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Attention of packed queries against a paged KV cache; plain or differential.

    One call serves prefill, chunked prefill, prefix-cache hits, decode and multi-token
    decode, mixed in one batch: sequence ``b`` owns queries
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys ``0 .. seq_lens[b]-1`` (new tokens
    included, already written by :func:`reshape_and_cache`), stored in blocks
    ``block_table[b, :ceil(seq_lens[b] / block_size)]``. Semantics follow
    ``flash_attn_with_kvcache`` (bottom-right causal alignment, GQA/MQA, sliding window,
    softcap, ALiBi); the docstring of :mod:`compiled_attn.ops.reference` gives the exact
    math. Rows that see no key (padding, ``seq_lens[b] == 0``) are zeros.

    Args:
        query: ``[num_tokens, num_heads, head_size]`` float16, bfloat16 or float32.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``,
            query's dtype or ``torch.float8_e4m3fn`` (an fp8 KV cache, any query dtype);
            ``num_heads % num_kv_heads == 0``; ``head_size`` any int from 1 to 256 (as
            flash-attn).
        cu_seqlens_q: ``[num_seqs + 1]`` int32, cumulative query counts starting at 0.
        seq_lens: ``[num_seqs]`` int32, keys per sequence (context + new tokens).
        block_table: ``[num_seqs, max_blocks_per_seq]`` int32 block ids.
        lambda_full: ``None`` for plain attention. For differential attention (Ye et al.
            2024, arXiv 2410.05258, eq. 1), a float tensor of shape ``[]`` or
            ``[num_heads // 2]``; heads and KV heads are interleaved pairs (``2j``,
            ``2j + 1``) and the result is ``attn(q1, k1, [v1, v2]) - lambda *
            attn(q2, k2, [v1, v2])`` combined in float32, before the head norm.
        scale: softmax scale, default ``head_size ** -0.5``.
        causal: bottom-right aligned causal mask (False for cross-attention).
        window_size: ``(left, right)`` sliding window in tokens, ``-1`` unbounded.
        softcap: ``> 0`` applies ``softcap * tanh(score / softcap)``; ``None`` or 0: none.
            Under ``torch.compile``, a given ``scale`` or ``softcap`` reaches the op as a
            tensor (it may change between calls without a recompile), which keeps the call
            on our kernels; at their defaults a call can run through flash-attn
            (:mod:`compiled_attn.ops.flash_backend`).
        alibi_slopes: ``[num_heads]`` float32 or ``None``.
        k_scale, v_scale: float8_e4m3fn caches only: float32 tensors of shape ``[]`` or
            ``[1]``, finite and > 0, or ``None`` (1). The cache holds ``x / scale`` in fp8
            (:func:`~compiled_attn.ops.reshape_and_cache`) and attention reads
            ``k = key_cache.to(float32) * k_scale``, ``v = value_cache.to(float32) * v_scale``
            (vLLM's fp8 KV cache: ``kv_cache_dtype="fp8"``, ``k_scale``, ``v_scale``). The
            kernels dequantize in registers: fp8 converts exactly to the query's dtype,
            ``k_scale`` multiplies the softmax scale and ``v_scale`` the output.

    Returns:
        ``[num_tokens, num_heads, head_size]`` (plain) or
        ``[num_tokens, num_heads // 2, 2 * head_size]`` (differential), query's dtype.

    Raises:
        TypeError: wrong dtype (e.g. ``block_table`` not int32, a cache neither the
            query's dtype nor float8_e4m3fn, a scale not float32), ``scale``, ``softcap``,
            ``window_size`` or ``causal`` of the wrong type.
        ValueError: inconsistent shapes, unsupported head size or head counts, ``k_scale``
            or ``v_scale`` with a cache that is not fp8 or of more than one element, and when
            eager: block ids outside the cache, ``seq_lens`` beyond the block table,
            malformed ``cu_seqlens_q``, ``scale`` not finite and > 0, ``softcap`` < 0,
            ``k_scale``/``v_scale`` not finite and > 0.
    """
    window_left, window_right, softcap, given = _options(scale, window_size, softcap, causal)
    if not torch.compiler.is_compiling():
        check_paged_args(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full,
                         window_left, window_right, softcap, alibi_slopes, None, k_scale, v_scale)
    scale, softcap, scale_softcap = _scalars(query, scale, softcap, given)
    if should_check(query):
        check_paged_values(query, key_cache, cu_seqlens_q, seq_lens, block_table)
        check_kv_scale_values(k_scale, v_scale)
    return PAGED_ATTENTION(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full,
                           scale, causal, window_left, window_right, softcap, alibi_slopes, scale_softcap,
                           k_scale, v_scale)


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    lambda_full: Tensor | None = None, *, scale: float | None = None, causal: bool = True,
    window_size: Window = (-1, -1), softcap: float | None = None, alibi_slopes: Tensor | None = None,
) -> Tensor:
    """Attention over packed contiguous q/k/v, as ``flash_attn_varlen_func``.

    For prefills with no cached context, encoders (``causal=False``) and training-style
    batches (the op has a backward: gradients reach ``q``, ``k``, ``v`` and
    ``lambda_full``). Sequence ``b`` owns queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and
    keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.

    Args:
        q: ``[total_q, num_heads, head_size]``; k, v: ``[total_k, num_kv_heads, head_size]``,
            one dtype among float16, bfloat16, float32.
        cu_seqlens_q, cu_seqlens_k: ``[num_seqs + 1]`` int32.
        lambda_full, scale, causal, window_size, softcap, alibi_slopes: as
            :func:`paged_attention`.

    Returns:
        ``[total_q, num_heads, head_size]`` or, differential,
        ``[total_q, num_heads // 2, 2 * head_size]``, in q's dtype.

    Raises:
        TypeError, ValueError: as :func:`paged_attention` (malformed ``cu_seqlens_q`` or
        ``cu_seqlens_k`` when eager).
    """
    window_left, window_right, softcap, given = _options(scale, window_size, softcap, causal)
    if not torch.compiler.is_compiling():
        check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, window_left, window_right,
                          softcap, alibi_slopes)
    scale, softcap, scale_softcap = _scalars(q, scale, softcap, given)
    if should_check(q):
        check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k)
    return VARLEN_ATTENTION(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left,
                            window_right, softcap, alibi_slopes, scale_softcap)
