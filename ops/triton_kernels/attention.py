"""Host-side launchers of the attention kernel: paged and varlen, plain and differential.

Each launcher takes its op's schema arguments as they are (see :mod:`compiled_attn.ops.attention`)
and is bound as the op's CUDA kernel, so an op call reaches it straight from the
dispatcher. No value checks here (the public functions do them). Every launch decision
reads shapes only, never values, and is made once per shape key (:class:`LaunchSpec`, from
:func:`launch_plan`); the kernels launch through :class:`~.launch_utils.CachedLauncher`, which
skips Triton's per-call argument binding. A call costs the key, a lookup, the output (and
split partials) allocation and the launches. They accept CUDA tensors, or CPU tensors when
``TRITON_INTERPRET=1`` (tests).

A float8_e4m3fn paged cache (vLLM's fp8 KV cache) is read as it is: the kernel converts each
loaded K/V tile to the query's dtype (exact: every float8_e4m3fn value is a float16, bfloat16
and float32 value), folds ``k_scale`` into the softmax scale and multiplies the output by
``v_scale``; so the cache's bytes cross the memory bus once, at one byte an element.
"""

from __future__ import annotations

import functools
from typing import Iterable, NamedTuple

import torch
from torch import Tensor

from ..arith import cdiv
from ..attention import default_scale, output_buffer
from .attention_kernel import attention_kernel
from .config import TileConfig, choose_num_splits, choose_tiles
from .launch_utils import (BoundedCache, CachedLauncher, alignments, device_guard, multiprocessor_count,
                           next_power_of_2, tracing_launches)
from .merge_kernel import merge_block_v, merge_splits_kernel
from . import gluon_prefill
from .prefill import covers as prefill_covers
from .prefill import covers_paged as paged_prefill_covers
from .prefill import is_hopper, paged_prefill, varlen_prefill

PREFILL_KERNEL = "hopper"
"""Which kernel serves ``varlen_attention`` on CUDA: ``"unified"`` (:mod:`.attention_kernel`,
every call) or ``"hopper"`` (:mod:`.prefill` for the calls its ``covers`` accepts on an sm90
GPU: fp16/bf16, head size 64/128/256 (differential 64/128), no ALiBi, no forced split count;
the unified kernel for the rest; tiles: ``HOPPER_TILES`` when K/V go through TMA, else
``PAGED_TILES``; :func:`prefill_kernel_takes`). ``"hopper"`` as measured on the H200
(2026-12-01, bf16, causal, Hq 32, Hkv 8, D 128, ``profiling/bench_kernels.py --parts
prefill``): B=8 S=2048 plain 0.758 ms against the unified kernel's 0.806, differential 0.929
against 1.667 (64 sequences of 128-4096 tokens: 8.26 / 9.02 plain, 11.02 / 18.73
differential), for the head sizes of :data:`PREFILL_HEAD_SIZES`. Read at each call (and at
trace time under ``torch.compile``), so a benchmark can flip it."""

PREFILL_HEAD_SIZES = frozenset({128})
"""Head sizes whose covered ``varlen_attention`` calls ``PREFILL_KERNEL = "hopper"`` routes to
the Hopper prefill kernel: those timed faster there (above). 64 and 256 are covered and tested
on the H200 but not yet timed against the unified kernel, which keeps them."""

PAGED_PREFILL_KERNEL = "unified"
"""Which kernel serves ``paged_attention`` on CUDA: ``"unified"`` (every call) or
``"hopper"``: :func:`.prefill.paged_prefill` (the prefill kernel's ``PAGED`` path)
for the calls :func:`.prefill.covers_paged` accepts: fp16/bf16 caches of the query's
dtype (no float8 cache), head size 64/128/256 (differential 64/128), no ALiBi, a
power-of-two block size, no forced split count or tiles, and query runs of at least one
query tile on average (``T >= block_m * B``, 128 tokens a sequence at ``PAGED_TILES``);
the unified kernel for the rest (decode, mixed batches of mostly decode rows). On the H200
(2026-12-01, B=8, 512 new tokens after 4096 cached, block 16, D 128, ``profiling/bench_kernels.py
--parts prefill``) the paged path took 0.817 ms against the unified kernel's 1.161 plain and
1.922 against 2.105 differential; the default stays ``"unified"`` until the engine's GPU tests
(mixed-step graphs, chunked prefill, prefix hits) have run with it. Read at each call (and at
trace time under ``torch.compile``), so a benchmark can flip it."""


GLUON_PREFILL = True
"""Whether prefill runs on the warp-specialized Gluon kernel (:mod:`.gluon_prefill`) where it
covers the call, before the routes above: ``varlen_attention`` calls :func:`gluon_takes_varlen`
takes and ``paged_attention`` calls :func:`gluon_takes_paged` takes (differential ones also
need :data:`GLUON_DIFFERENTIAL`). On the H200 (2026-12-02, bf16, causal, Hq 32, Hkv 8, D 128,
``profiling/bench_kernels.py --parts gluon``, the 20th session's run) plain prefill took 0.548
ms at B=8 S=2048 against 0.753 for the Hopper prefill kernel and 0.556 for flash-attn 4 (6.70 /
8.37 / 6.52 ms for 64 sequences of 128-4096 tokens), and paged prefill (512 new tokens after
4096 cached, block 16; tiles without ``early_waits``) 0.546 ms against 0.550 for flash-attn 4's
paged call, 0.817 for the Hopper kernel's paged path (2026-12-01) and 1.161 for the unified
kernel, which served it.
Read at each call, and at trace time: a graph traced or captured with it off keeps the
kernels it got. Under ``torch.compile`` the calls it takes stay opaque (a Gluon kernel cannot
be traced into Inductor's code: ``ops/backends.py``)."""

GLUON_DIFFERENTIAL = True
"""Whether differential calls the Gluon kernel covers run there too (its fused schedule: the
two components on its two consumer warpgroups, each key/value tile loaded once). On the H200
(2026-12-02, same call as :data:`GLUON_PREFILL`'s numbers) it took 0.854 ms at B=8 S=2048
against 0.954 for the Hopper prefill kernel's sequential schedule, which served these calls
before, and 0.967 for flash-attn 4's two calls (9.91 / 11.28 / 11.39 ms for 64 sequences of
128-4096 tokens); paged (512 new after 4096 cached, block 16) 0.859 ms, where the unified
kernel had served it (2.105 ms on 2026-12-01). Off: the routes above, as before."""


def gluon_takes_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full=None, scale=None, causal=True,
                       window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, scale_softcap=None) -> bool:
    """Whether :func:`varlen_attention` (with no forced split count) runs these schema
    arguments on the Gluon kernel: :data:`GLUON_PREFILL` (differential: and
    :data:`GLUON_DIFFERENTIAL`) and :func:`.gluon_prefill.covers` (shapes, strides, dtypes
    and options only: the ``opaque`` predicate of the traced op)."""
    return (GLUON_PREFILL and (lambda_full is None or GLUON_DIFFERENTIAL)
            and gluon_prefill.covers(q, k, v, lambda_full, scale, window_left, softcap, alibi_slopes, scale_softcap))


def gluon_takes_paged(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full=None,
                      scale=None, causal=True, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                      scale_softcap=None, k_scale=None, v_scale=None) -> bool:
    """Whether :func:`paged_attention` (with no forced split count or tiles) runs these schema
    arguments on the Gluon kernel: :data:`GLUON_PREFILL` (differential: and
    :data:`GLUON_DIFFERENTIAL`), :func:`.gluon_prefill.covers_paged`
    (a 16-bit cache of the query's dtype) and a prefill-heavy batch, at least one work tile of
    queries a sequence (``T >= 128 B``: chunked prefill, prefix hits); a decode step or a batch
    of mostly decode rows stays on the unified kernel, which packs a GQA group's rows into one
    tile. Shapes only."""
    tile_m = 2 * gluon_prefill.TILES.block_m
    return (GLUON_PREFILL and (lambda_full is None or GLUON_DIFFERENTIAL)
            and query.shape[0] >= tile_m * max(seq_lens.shape[0], 1)
            and gluon_prefill.covers_paged(query, key_cache, value_cache, lambda_full, scale, window_left, softcap,
                                           alibi_slopes, scale_softcap))


def prefill_kernel_serves(head_size: int, tensor: Tensor) -> bool:
    """Whether :func:`varlen_attention` runs covered calls of ``head_size`` on ``tensor``'s
    device through the Hopper prefill kernel: :data:`PREFILL_KERNEL` ``"hopper"``,
    ``head_size`` in :data:`PREFILL_HEAD_SIZES`, an NVIDIA sm90 GPU (:func:`.prefill.is_hopper`:
    the kernel's tiles are sized for its shared memory). Reads no tensor values."""
    return (PREFILL_KERNEL == "hopper" and head_size in PREFILL_HEAD_SIZES and tensor.is_cuda
            and is_hopper(tensor.get_device()))


def prefill_kernel_takes(q: Tensor, k: Tensor, v: Tensor, lambda_full: Tensor | None,
                         alibi_slopes: Tensor | None) -> bool:
    """Whether :func:`varlen_attention` (with no forced split count) runs this call through
    the Hopper prefill kernel: :func:`prefill_kernel_serves` its head size and device, and
    :func:`.prefill.covers` the call (dtypes, ALiBi, grid limits). Shapes and dtypes only."""
    return prefill_kernel_serves(q.shape[-1], q) and prefill_covers(q, k, v, lambda_full, alibi_slopes)


UNBOUNDED = 1 << 30  # a distance no sequence reaches
SPLIT_ALIGN = 16  # elements: every split of the split buffers starts at a multiple (split_strides)


def visibility_bounds(causal: bool, window_left: int, window_right: int) -> tuple[int, int]:
    """``(min_dist, max_dist)`` such that key ``j`` is visible from key position ``p``
    exactly when ``min_dist <= p - j <= max_dist`` (causal and sliding window folded)."""
    if causal:
        min_dist = 0
    else:
        min_dist = -window_right if window_right >= 0 else -UNBOUNDED
    max_dist = window_left if window_left >= 0 else UNBOUNDED
    return min_dist, max_dist


def paged_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, cu_seqlens_q: Tensor,
    seq_lens: Tensor, block_table: Tensor, lambda_full: Tensor | None = None,
    scale: float | None = None, causal: bool = True, window_left: int = -1, window_right: int = -1,
    softcap: float = 0.0, alibi_slopes: Tensor | None = None, scale_softcap: Tensor | None = None,
    k_scale: Tensor | None = None, v_scale: Tensor | None = None, *,
    out: Tensor | None = None, num_splits: int | None = None, tiles: TileConfig | None = None,
) -> Tensor:
    """The ``compiled_attn::paged_attention`` op on CUDA (arguments as its schema).

    Args:
        query: ``[T, Hq, D]``; key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``,
            query's dtype or float8_e4m3fn.
        cu_seqlens_q: ``[B + 1]`` int32; seq_lens: ``[B]`` int32; block_table:
            ``[B, max_blocks]`` int32.
        lambda_full ... scale_softcap: as :func:`compiled_attn.ops.paged_attention` and the
            op schema (``scale=None``: ``D ** -0.5``).
        k_scale, v_scale: float32 ``[]``/``[1]`` dequantization scales of a float8_e4m3fn
            cache (``k = cache * k_scale``), or ``None`` (1); ignored for other caches.
        out: optional output buffer (``[T, Hq, D]`` or ``[T, Hq/2, 2D]``, query's dtype, last
            dim contiguous); a new tensor otherwise.
        num_splits: force this many flash-decoding splits (tests); default from shapes.
        tiles: force these tiles (tests, ``profiling/bench_kernels.py --fp8-sweep``); default
            from shapes (:func:`.config.choose_tiles`).

    Returns:
        ``out``.
    """
    max_kv_len = block_table.shape[1] * key_cache.shape[1]
    if key_cache.dtype != torch.float8_e4m3fn:
        k_scale = v_scale = None
    if (num_splits is None and tiles is None and not tracing_launches()
            and gluon_takes_paged(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full,
                                  scale, causal, window_left, window_right, softcap, alibi_slopes, scale_softcap)
            and gluon_prefill.launch_problem(query, key_cache, value_cache, out, lambda_full is not None) is None):
        return gluon_prefill.launch(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full,
                                    scale, causal, window_right, out, None)
    if (PAGED_PREFILL_KERNEL == "hopper" and num_splits is None and tiles is None and query.is_cuda
            and paged_prefill_covers(query, key_cache, value_cache, seq_lens.shape[0], lambda_full, alibi_slopes)):
        return paged_prefill(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full, scale,
                             causal, window_left, window_right, softcap, None, scale_softcap, out=out)
    return _attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, max_kv_len,
                      lambda_full, scale, causal, window_left, window_right, softcap, alibi_slopes,
                      scale_softcap, out, num_splits, k_scale, v_scale, tiles)


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    lambda_full: Tensor | None = None, scale: float | None = None, causal: bool = True,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    alibi_slopes: Tensor | None = None, scale_softcap: Tensor | None = None, *,
    out: Tensor | None = None, num_splits: int | None = None,
) -> Tensor:
    """The ``compiled_attn::varlen_attention`` op on CUDA: attention over packed contiguous
    ``k``/``v`` ``[total_k, Hkv, D]``, as ``flash_attn_varlen_func``; plain or
    differential. Other arguments as :func:`paged_attention`. Calls :func:`gluon_takes_varlen`
    takes go to :func:`.gluon_prefill.launch`; then, with :data:`PREFILL_KERNEL`
    ``"hopper"``, covered calls go to :func:`.prefill.varlen_prefill`."""
    if (num_splits is None and not tracing_launches()
            and gluon_takes_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left,
                                   window_right, softcap, alibi_slopes, scale_softcap)
            and gluon_prefill.launch_problem(q, k, v, out, lambda_full is not None) is None):
        return gluon_prefill.launch(q, k, v, cu_seqlens_q, cu_seqlens_k, None, lambda_full, scale, causal,
                                    window_right, out, None)
    if num_splits is None and prefill_kernel_takes(q, k, v, lambda_full, alibi_slopes):
        return varlen_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, lambda_full, scale, causal, window_left,
                              window_right, softcap, None, scale_softcap, out=out)
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, None, k.shape[0], lambda_full, scale, causal,
                      window_left, window_right, softcap, alibi_slopes, scale_softcap, out, num_splits)


class LaunchPlan(NamedTuple):
    """What the shape heuristic picks for one launch (see :mod:`.config`)."""

    tiles: TileConfig
    num_splits: int
    group_pad: int  # query heads (pairs) per KV head (pair), padded to a power of two
    head_size_pad: int  # any head size (1 to 256) padded to a power of two >= 16 (tl.dot's K)
    num_kv_units: int  # KV heads (plain) or KV head pairs (differential): grid axis 1


def launch_plan(query: Tensor, num_kv_heads: int, num_seqs: int, max_kv_len: int,
                differential: bool, kv_dtype: torch.dtype | None = None) -> LaunchPlan:
    """Tiles and flash-decoding splits for these shapes (``max_kv_len`` bounds any
    sequence's keys) and the cache's dtype ``kv_dtype`` (``None``: the query's); reads no
    tensor values."""
    num_tokens, num_heads, head_size = query.shape
    return _launch_plan(num_tokens, num_heads, head_size, num_kv_heads, num_seqs, max_kv_len, differential,
                        query.dtype, multiprocessor_count(query.device), kv_dtype)


@functools.lru_cache(maxsize=4096)
def _launch_plan(num_tokens: int, num_heads: int, head_size: int, num_kv_heads: int, num_seqs: int,
                 max_kv_len: int, differential: bool, dtype: torch.dtype, num_sms: int,
                 kv_dtype: torch.dtype | None = None) -> LaunchPlan:
    group_pad = next_power_of_2(num_heads // num_kv_heads)
    head_size_pad = max(16, next_power_of_2(head_size))
    num_kv_units = num_kv_heads // 2 if differential else num_kv_heads
    tiles = choose_tiles(num_tokens, num_seqs, group_pad, head_size_pad, differential, dtype, kv_dtype)
    num_splits = choose_num_splits(num_seqs, num_tokens, tiles.block_q(group_pad), num_kv_units,
                                   max_kv_len, tiles.programs_per_sm, num_sms)
    return LaunchPlan(tiles, num_splits, group_pad, head_size_pad, num_kv_units)


def kernel_variant(plan: LaunchPlan) -> tuple:
    """What decides the compiled kernels a launch runs (Triton compiles one variant per
    value): the tiles, and the split count rounded up to a power of two (the merge kernel's
    ``SPLITS_PAD``; 1 when there is no split). Arguments that change with the batch are
    not specialized (``do_not_specialize``), so nothing else varies for one model."""
    return plan.tiles, next_power_of_2(plan.num_splits) if plan.num_splits > 1 else 1


def distinct_variants(launches: Iterable[tuple[int, int]], num_heads: int, num_kv_heads: int,
                      head_size: int, differential: bool, dtype: torch.dtype, device: torch.device,
                      max_kv_len: int | None = None) -> list[tuple[int, int]]:
    """The first ``(num_seqs, num_tokens)`` of ``launches`` for each :func:`kernel_variant`
    they reach: paged with keys bounded by ``max_kv_len``, or varlen self-attention over
    the batch's own tokens (``max_kv_len=None``). Reads shapes only."""
    first: dict[tuple, tuple[int, int]] = {}
    num_sms = multiprocessor_count(device)
    for num_seqs, num_tokens in launches:
        keys = num_tokens if max_kv_len is None else max_kv_len
        plan = _launch_plan(num_tokens, num_heads, head_size, num_kv_heads, num_seqs, keys, differential,
                            dtype, num_sms)
        first.setdefault(kernel_variant(plan), (num_seqs, num_tokens))
    return list(first.values())


class LaunchSpec(NamedTuple):
    """Everything a launch takes from the shapes, strides and flags of its tensors, computed
    once per :func:`_spec_key` value."""

    grid: tuple[int, int, int]
    int_args: tuple[int, ...]  # strides of q, k, v, the block table, the target and the lse
    constexprs: dict
    options: dict  # num_warps, num_stages (maxnreg)
    split_shape: tuple[int, ...] | None  # float32 partials [S, T, Hq, Dv]; None: no split
    merge_grid: tuple[int, int, int]
    merge_args: tuple[int, ...]  # num_splits and the strides of the merge
    merge_constexprs: dict


_SPECS: BoundedCache = BoundedCache()
_ATTENTION = CachedLauncher(attention_kernel)
_MERGE = CachedLauncher(merge_splits_kernel)


def _spec_key(query, key, value, num_seqs, block_table, max_kv_len, lambda_full, softcap, alibi_slopes,
              scale_softcap, out, num_splits, k_scale, v_scale, tiles, pointers) -> tuple:
    """What a launch spec and the compiled kernel variants depend on: shapes, strides,
    flags, the device, the dtypes (the cache's: float8_e4m3fn or not) and the 16-byte
    alignment of every pointer (never values)."""
    return (query.shape, query.stride(), key.shape, key.stride(), value.stride(), query.dtype, key.dtype,
            num_seqs, None if block_table is None else (block_table.shape, block_table.stride()), max_kv_len,
            None if lambda_full is None else (lambda_full.numel(), lambda_full.dtype), softcap > 0,
            alibi_slopes is None, scale_softcap is None, k_scale is None, v_scale is None, out.stride(),
            num_splits, tiles, query.get_device(), alignments(pointers))


def _launch_spec(query, key, value, num_seqs, block_table, max_kv_len, lambda_full, softcap, alibi_slopes,
                 scale_softcap, out, num_splits, k_scale, v_scale, tiles) -> LaunchSpec:
    differential = lambda_full is not None
    paged = block_table is not None
    num_tokens, num_heads, head_size = query.shape
    plan = _launch_plan(num_tokens, num_heads, head_size, key.shape[-2], num_seqs, max_kv_len, differential,
                        query.dtype, multiprocessor_count(query.device), key.dtype)
    tiles = plan.tiles if tiles is None else tiles
    num_splits = plan.num_splits if num_splits is None else num_splits
    if paged:
        k_strides, v_strides = key.stride(), value.stride()
        table_stride, block_size = block_table.stride(0), key.shape[1]
    else:  # token-major [total_k, Hkv, D]: the "block" stride is the token stride
        k_strides = (key.stride(0), 0, key.stride(1), key.stride(2))
        v_strides = (value.stride(0), 0, value.stride(1), value.stride(2))
        table_stride, block_size = 0, 1  # no block table
    value_size = 2 * head_size if differential else head_size
    split = num_splits > 1
    split_shape = (num_splits, num_tokens, num_heads, value_size) if split else None
    if split:
        target_strides, lse_strides = split_strides(split_shape)
    else:
        target_strides, lse_strides = (0, *out.stride()), (0, 0, 0)
    lambda_per_pair = differential and lambda_full.numel() > 1
    constexprs = dict(
        BLOCK_SIZE=block_size, PAGED=paged, DIFFERENTIAL=differential, STACKED=tiles.stacked, SPLIT=split,
        SOFTCAP=softcap > 0 or scale_softcap is not None, ALIBI=alibi_slopes is not None,
        LAMBDA_PER_PAIR=lambda_per_pair, RUNTIME_SCALARS=scale_softcap is not None,
        K_SCALED=k_scale is not None, V_SCALED=v_scale is not None,
        F16_TILES=key.dtype == torch.float8_e4m3fn and query.dtype == torch.bfloat16, HEAD_SIZE=head_size,
        HEAD_SIZE_PAD=plan.head_size_pad, GROUP=num_heads // key.shape[-2], GROUP_PAD=plan.group_pad,
        BLOCK_M=tiles.block_m, TILE_N=tiles.tile_n)
    block_v = merge_block_v(next_power_of_2(value_size), next_power_of_2(num_splits))
    merge_constexprs = dict(
        VALUE_SIZE=value_size, BLOCK_V=block_v, SPLITS_PAD=next_power_of_2(num_splits),
        DIFFERENTIAL=differential, LAMBDA_PER_PAIR=lambda_per_pair)
    return LaunchSpec(
        grid=(num_tokens // tiles.block_q(plan.group_pad) + num_seqs, plan.num_kv_units, num_splits),
        int_args=(*query.stride(), *k_strides, *v_strides, table_stride, *target_strides, *lse_strides),
        constexprs=constexprs, options=tiles.options(),
        split_shape=split_shape, merge_grid=(num_tokens, out.shape[1], cdiv(value_size, block_v)),
        merge_args=(num_splits, *target_strides[:3], *lse_strides[:2], out.stride(0), out.stride(1)),
        merge_constexprs=merge_constexprs)


def split_strides(shape: tuple[int, int, int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Strides of the float32 partial outputs ``shape = [num_splits, T, Hq, Dv]`` and
    log-sum-exps ``[num_splits, T, Hq]`` of a flash-decoding launch: dense within a split,
    and every split starting at a multiple of ``SPLIT_ALIGN`` elements. The split strides
    are then 16-divisible for every batch, so Triton specializes them (one compiled variant
    whatever ``T``): left unspecialized, they cost the plain decode kernel 36 registers a
    thread (128 -> 164 for sm90, Hq 32, Hkv 8, D 128), a resident program per
    multiprocessor, and 12% of its KV bandwidth at B=64 (H200, 2026-12-01)."""
    num_splits, num_tokens, num_heads, value_size = shape
    return ((cdiv(num_tokens * num_heads * value_size, SPLIT_ALIGN) * SPLIT_ALIGN, num_heads * value_size,
             value_size, 1),
            (cdiv(num_tokens * num_heads, SPLIT_ALIGN) * SPLIT_ALIGN, num_heads, 1))


def split_buffers(shape: tuple[int, int, int, int], device) -> tuple[Tensor, Tensor]:
    """Uninitialized partial outputs ``[num_splits, T, Hq, Dv]`` and log-sum-exps
    ``[num_splits, T, Hq]`` (float32, strides :func:`split_strides`) of a flash-decoding
    launch (the merge reads only what the attention kernel wrote)."""
    return tuple(torch.empty(shape[0] * strides[0], dtype=torch.float32, device=device).as_strided(size, strides)
                 for size, strides in zip((shape, shape[:3]), split_strides(shape)))


def _attention(query, key, value, cu_seqlens_q, kv_lens, block_table, max_kv_len, lambda_full, scale,
               causal, window_left, window_right, softcap, alibi_slopes, scale_softcap, out, num_splits,
               k_scale=None, v_scale=None, tiles=None):
    """Launch the unified kernel (and the split merge). ``block_table is None`` means
    contiguous k/v with ``kv_lens = cu_seqlens_k``; else paged with ``kv_lens = seq_lens``.
    ``k_scale``/``v_scale``: dequantization scales of an fp8 cache, or ``None``; ``tiles``:
    forced tiles, or ``None``."""
    num_tokens, _, head_size = query.shape
    out = output_buffer(query, lambda_full is not None, out)
    if num_tokens == 0:
        return out
    scale = default_scale(scale, head_size)
    # The kernels index metadata as dense vectors and block_table by its row stride: views
    # with other strides are copied (no-ops for the engine's own contiguous buffers).
    cu_seqlens_q, kv_lens = cu_seqlens_q.contiguous(), kv_lens.contiguous()
    if block_table is not None and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    lambda_full = None if lambda_full is None else lambda_full.contiguous()
    alibi_slopes = None if alibi_slopes is None else alibi_slopes.contiguous()
    # Pointer arguments of disabled features point at the query (never read).
    table = kv_lens if block_table is None else block_table
    pointers = (query, key, value, cu_seqlens_q, kv_lens, table, out,
                *(query if t is None else t for t in (lambda_full, alibi_slopes, scale_softcap, k_scale, v_scale)))
    num_seqs = cu_seqlens_q.shape[0] - 1
    spec_args = (query, key, value, num_seqs, block_table, max_kv_len, lambda_full, softcap, alibi_slopes,
                 scale_softcap, out, num_splits, k_scale, v_scale, tiles)
    shape_key = _spec_key(*spec_args, pointers)
    spec = _SPECS.get(shape_key)
    if spec is None:
        spec = _SPECS[shape_key] = _launch_spec(*spec_args)
    if spec.split_shape is None:
        target, lse = out, out  # lse unused
    else:
        target, lse = split_buffers(spec.split_shape, query.device)
    min_dist, max_dist = visibility_bounds(causal, window_left, window_right)
    device_index = query.get_device()
    with device_guard(query):
        _ATTENTION(shape_key, spec.grid, (target, lse, *pointers[:6], *pointers[7:], num_seqs, scale, softcap,
                                     min_dist, max_dist, *spec.int_args),
                   device_index, lambda: (spec.constexprs, spec.options))
        if spec.split_shape is not None:
            _MERGE(shape_key, spec.merge_grid, (out, target, lse, pointers[7], *spec.merge_args), device_index,
                   lambda: (spec.merge_constexprs, {}))
    return out
