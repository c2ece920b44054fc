"""Host side of the warp-specialized Gluon prefill kernel (:mod:`.gluon_prefill_kernel`):
which calls it serves (:func:`covers`, :func:`covers_paged`), its checked launchers
(:func:`varlen_prefill`, :func:`paged_prefill`) and the unchecked :func:`launch` the ops call
after their own checks.

The kernel serves causal (or right-windowed) prefill of fp16/bf16 at head sizes 64 and 128
on an NVIDIA sm90 GPU, plain or fused differential, contiguous K/V or a paged cache;
everything else (softcap, left windows, ALiBi, float8 caches, other head sizes) stays with
:mod:`.prefill`. Its TMA descriptors are built on the host over the whole tensors (no
device-side descriptor, no global scratch); a Gluon kernel cannot be traced into Inductor's
code, so under ``torch.compile`` the calls it takes stay opaque (``ops/backends.py``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from ..attention import default_scale, output_buffer
from ..validation import (check_call_options, check_paged_args, check_same_device, check_scalars, check_tensor,
                          check_varlen_args)
from ..value_checks import check_paged_values, check_varlen_values, should_check
from .launch_utils import device_guard, multiprocessor_count
from .prefill import is_hopper

LOG2E = 1.4426950408889634
UNBOUNDED = 1 << 30  # a distance no sequence reaches (as attention.visibility_bounds)
HEAD_SIZES = (64, 128)


class GluonTiles(NamedTuple):
    """``block_m`` query rows a consumer (the work tile is ``2 * block_m``), ``block_n`` keys
    a step, ``stages`` key/value buffers; ``overlap`` and ``pingpong``: FlashAttention-3's
    intra- and inter-warpgroup schedules (the kernel's ``OVERLAP``, ``PINGPONG``);
    ``values_first``: overlap's step issues the previous tile's ``p v`` before this tile's
    scores and retires both before the softmax (the kernel's ``VALUES_FIRST``);
    ``early_waits``: overlap's step waits for the next step's keys and values while its
    wgmma run (the kernel's ``EARLY_WAITS``);
    ``dynamic``: work tiles claimed from an atomic counter, not dealt round-robin (the
    kernel's ``DYNAMIC``; a zeroed ``[1]`` int32 counter a launch); ``lazy_rescale``:
    flash-attn 4's lazy rescaling, the accumulator rescaled only when a row's running
    maximum moves by more than ``2^8`` (the kernel's ``LAZY_RESCALE``)."""

    block_m: int = 64
    block_n: int = 128
    stages: int = 2
    overlap: bool = False
    pingpong: bool = False
    dynamic: bool = False
    values_first: bool = False
    early_waits: bool = False
    lazy_rescale: bool = False

    def label(self) -> str:
        """``64x128 s2`` with each set schedule's name appended (`` overlap``, `` values-first``,
        `` early-waits``, `` pingpong``, `` dynamic``, `` lazy-rescale``; benchmark rows)."""
        schedules = (" overlap" * self.overlap + " values-first" * self.values_first
                     + " early-waits" * self.early_waits + " pingpong" * self.pingpong + " dynamic" * self.dynamic
                     + " lazy-rescale" * self.lazy_rescale)
        return f"{self.block_m}x{self.block_n} s{self.stages}{schedules}"


# H200 (2026-12-02, bf16, causal, Hq 32, Hkv 8, D 128, profiling/bench_kernels.py --parts gluon; the
# kernel of that day's first runs, consumers at 232 registers): with both schedules 0.608 ms at B=8
# S=2048 and 7.36 ms for 64 sequences of 128-4096 tokens, against 0.636 / 7.91 with neither, 0.618 /
# 7.42 overlap only, 0.661 / 7.79 pingpong only (the two runs before, at 240 registers, ranked them
# the same; 64x64 s3 with both: 0.641 / 7.93). The kernel of 2026-12-02's last runs: 0.570 / 6.97 ms
# (flash-attn 4 0.569 / 6.70 in that call); with `dynamic` 0.572 / 7.01 (two calls: 0.4-2.3% slower).
# `values_first` (2026-12-02, two rounds in one call, against the same tiles without): 0.537 / 0.539
# ms against 0.570 / 0.567 for the paged prefill of 512 tokens after 4096 (B=8, block 16), 6.68 /
# 6.61 against 6.69 / 6.71 for the 64 sequences, 0.969 / 0.972 against 0.984 / 0.983 non-causal B=8
# S=2048, B=1 S=16384 level; differential (its tiles below) 10.34 / 10.30 against 10.12 / 10.20 for
# the 64 sequences: left off there.
# `early_waits` (2026-12-02, three calls, against the same tiles without; the softmax of that day's
# last kernel: tree row maxima, the accumulator rescaled among the exponentials, probabilities packed
# in pairs): 0.5455 / 0.5481 ms against 0.5667 / 0.5574 at B=8 S=2048, 6.701 / 6.695 / 6.661 against
# 6.850 / 6.858 / 6.827 for the 64 sequences, 3.737 against 3.889 at B=1 S=16384. The same calls
# timed the differential schedule with it slower (0.8806 / 0.9159 ms against 0.8473 / 0.8535 at B=8
# S=2048), and a quarter of the exponentials on the FMA pipe (flash-attn 4's ex2 emulation)
# slower for both (plain 6.971 against 6.858 ms, differential 10.26 against 9.911): not kept.
# `lazy_rescale` with each warp deciding for its own 16 rows (2026-12-03, H200, profiling/gluon_ab.py,
# 5 rounds in turns, ms, against the same tiles without): 0.5350 against 0.5386 at B=8 S=2048, 6.409
# against 6.473 for the 64 sequences, 0.5271 against 0.5332 paged (8 of 512 after 4096, block 16);
# decided over the warpgroup (shared memory and a barrier a step) it had been slower (below). D 64
# not timed apart (the op at B=8 S=2048: 0.373 ms, 0.396 the day before without it).
TILES = GluonTiles(overlap=True, pingpong=True, values_first=True, early_waits=True, lazy_rescale=True)
# `dynamic` (2026-12-02, H100, profiling/gluon_ab.py, against the same tiles round-robin, each pair
# timed in turns, ms; waves: work tiles over the 132 programs): 0.2543 against 0.2662 at B=1 S=4096
# (8 waves), 0.2870 / 0.3010 at B=4 S=2048 (16), 0.1589 / 0.1751 for 16 sequences of 128-1024 tokens
# (20); 0.5560 / 0.5528 at B=8 S=2048 (33), 3.768 / 3.719 at B=1 S=16384 (31), 6.719 / 6.788 for the
# 64 sequences (284); the same kernel on both sides read 0.8674 / 0.8669. H200, same day: 0.5659
# against 0.5485 at B=8 S=2048, 6.783 / 6.790 for the 64 sequences. Dealt round-robin, a program's
# heaviest tiles can come last (a count of the key steps each program gets, a step a tile added,
# puts the slowest 3% above the mean at B=8 S=2048, 12% at B=1 S=4096, 23% for the 16 sequences;
# under 1.5% when claimed), while over many waves the programs keep in step on neighbouring tiles.
# So plain calls of fewer than DYNAMIC_MAX_WAVES waves claim their tiles (:func:`default_tiles`).
DYNAMIC_MAX_WAVES = 24
# Paged (a key tile a TMA copy a cache block): the same without early waits, round-robin. H100
# (2026-12-02, one call, each pair timed in turns, ms, early waits against not): 8 sequences of 512 new
# tokens after 4096 cached 0.5866 against 0.5562 at block 16, 0.5647 / 0.5318 at block 32, 0.5348 /
# 0.5261 at block 64; one of 2048 after 8192 0.6028 / 0.5969; 4 of 4096 (no prefix) 1.2134 / 1.1333;
# the same keys contiguous 0.5149 / 0.5273, 0.5254 / 0.5418, 0.5168 / 0.5320, 0.5377 / 0.5522, 1.0666 /
# 1.0947 (the paged producer's block-by-block copies land later: a step's early wait for them also
# holds back its releases). H200, block 16 (round-robin and dynamic, without and with early waits):
# 32 sequences of 128 after 2048 0.2978 / 0.3244 round-robin, 0.3303 / 0.3621 dynamic; the 8 of 512
# after 4096 0.5427 / 0.5901, 0.5559 / 0.5982.
PAGED_TILES = TILES._replace(early_waits=False)
# Differential (the two components on the two consumers, values [v1 | v2] 2D wide): 64-key steps at
# D 128 (shared memory: queries 64 KiB, keys 64, values 64, the o_2 exchange 32), 128 at D 64. H200
# (2026-12-02, D 128, the day's last runs): dynamic 0.874 ms at B=8 S=2048 against 0.957 round-robin
# in the same call (the Hopper prefill kernel's sequential schedule 0.96-1.00), 10.30 against 10.23
# for the 64 sequences (11.29); other tiles not timed. `lazy_rescale` at D 128 (2026-12-02, H200,
# profiling/gluon_ab.py, 3 rounds in turns, ms): 0.8280 against 0.8532 at B=8 S=2048, 9.608 against
# 9.998 for the 64 sequences (a step's 128 FMULs of its 64 x 256 accumulator skipped). The same
# call timed it for plain prefill: 0.5543 against 0.5481 at B=8 S=2048, 3.704 / 3.649 at B=1 S=16384,
# 6.727 / 6.730 for the 64 sequences, 0.5343 / 0.5428 paged (then decided over the warpgroup). Each
# warp deciding for its own rows (2026-12-03, 5 rounds in turns): 0.8209 against 0.8401 at B=8
# S=2048, 9.413 against 9.676 for the 64 sequences. D 64 (64 FMULs a step) not timed: left off.
DIFFERENTIAL_TILES = {64: GluonTiles(64, 128, 2, overlap=True, pingpong=True, dynamic=True),
                      128: GluonTiles(64, 64, 2, overlap=True, pingpong=True, dynamic=True, lazy_rescale=True)}


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton has Gluon's Hopper API with warp specialization (Triton 3.6, the
    H200's, and 3.9, CI's, have it)."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import tma, warpgroup_mma  # noqa: F401 (present?)
    except ImportError:
        return False
    return hasattr(gl, "warp_specialize")


def _dense_rows(tensor: Tensor) -> bool:
    """Whether ``tensor``'s last two dims ``[H, D]`` are dense and its rows (every dim
    before them) one 16-byte multiple apart: what a TMA descriptor over its ``[rows, H * D]``
    view reads (from a 16-byte-aligned start: :func:`launch_problem`), and, with more than
    one row, no closer than a row's ``H * D`` elements (a broadcast or overlapping view is
    neither a TMA descriptor's nor a store's). Strides only (fake tensors too)."""
    size = tensor.shape[-1]
    if tensor.stride(-1) != 1 or tensor.stride(-2) != size:
        return False
    if tensor.shape[-3] > 1 and tensor.stride(-3) < tensor.shape[-2] * size:
        return False
    for dim in range(tensor.dim() - 4, -1, -1):  # a cache's blocks: rows of blocks too
        if tensor.stride(dim) != tensor.shape[dim + 1] * tensor.stride(dim + 1):
            return False
    return (tensor.stride(-3) * tensor.element_size()) % 16 == 0


def _whole_pairs(q: Tensor, k: Tensor) -> bool:
    """Even query and key head counts: the differential kernel's interleaved pairs."""
    return q.shape[-2] % 2 == 0 and k.shape[-2] % 2 == 0


def launch_problem(q: Tensor, k: Tensor, v: Tensor, out: Tensor | None, differential: bool = False,
                   names: tuple[str, str, str] = ("q", "k", "v")) -> str | None:
    """What keeps the kernel from reading these tensors, or ``None``: fp16/bf16 of one dtype,
    head size 64 or 128, even head counts when ``differential``, every tensor's heads and dims
    dense with 16-byte-aligned rows (:func:`_dense_rows`) and start address (TMA
    descriptors), ``out`` (if given) likewise. The launch-time check (addresses);
    :func:`covers` checks the rest on shapes alone. ``names``: how the message calls ``q``,
    ``k`` and ``v`` (:func:`paged_prefill`'s ``query``, ``key_cache``, ``value_cache``)."""
    nq, nk, nv = names
    if differential and not _whole_pairs(q, k):
        return (f"differential heads come in pairs: {nq} and {nk} need even head counts, got {q.shape[-2]}, "
                f"{k.shape[-2]}")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"{nq}, {nk} and {nv} must share float16 or bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[-1] not in HEAD_SIZES or not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        return (f"{nq}, {nk} and {nv} must share a head size in {HEAD_SIZES}, got {q.shape[-1]}, {k.shape[-1]}, "
                f"{v.shape[-1]}")
    for name, tensor in ((nq, q), (nk, k), (nv, v), ("out", out)):
        if tensor is not None and not (_dense_rows(tensor) and tensor.data_ptr() % 16 == 0):
            return (f"{name} must have dense heads and dims, rows at least H * D elements apart (no broadcast "
                    f"or overlap) and 16-byte aligned, and a 16-byte-aligned address (a TMA descriptor reads it), "
                    f"got strides {tensor.stride()} at address {tensor.data_ptr()}")
    return None


def _takes_options(q: Tensor, k: Tensor, lambda_full, alibi_slopes, scale, window_left, softcap,
                   scale_softcap) -> bool:
    differential = lambda_full is not None
    return (alibi_slopes is None and scale_softcap is None and softcap <= 0 and window_left < 0
            and default_scale(scale, q.shape[-1]) > 0 and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] in HEAD_SIZES and k.shape[-2] > 0 and q.shape[-2] % k.shape[-2] == 0
            and (not differential or _whole_pairs(q, k))
            and _on_sm90(q))


def covers(q: Tensor, k: Tensor, v: Tensor, lambda_full: Tensor | None, scale: float | None, window_left: int,
           softcap: float, alibi_slopes: Tensor | None, scale_softcap: Tensor | None) -> bool:
    """Whether :func:`varlen_prefill` serves this ``varlen_attention`` call: plain, or
    differential (``lambda_full``; even head counts: interleaved pairs), no softcap, no left
    window, no ALiBi, a positive scale; fp16/bf16 q, k and v of one dtype, head size 64 or
    128, whole GQA groups (query heads a multiple of key heads), ``v`` shaped as ``k``; q, k
    and v TMA-readable by their strides (:func:`_dense_rows`; their addresses:
    :func:`launch_problem`, at launch); an sm90 GPU with Gluon. Shapes, strides and dtypes
    only (the ``opaque`` predicate of the traced op)."""
    return (_takes_options(q, k, lambda_full, alibi_slopes, scale, window_left, softcap, scale_softcap)
            and k.dtype == q.dtype and v.dtype == q.dtype and k.shape[-1] == q.shape[-1] and v.shape == k.shape
            and all(_dense_rows(t) for t in (q, k, v)))


def covers_paged(query: Tensor, key_cache: Tensor, value_cache: Tensor, lambda_full: Tensor | None,
                 scale: float | None, window_left: int, softcap: float, alibi_slopes: Tensor | None,
                 scale_softcap: Tensor | None) -> bool:
    """Whether :func:`paged_prefill` serves this ``paged_attention`` call: what
    :func:`covers` takes, over caches ``[num_blocks, block_size, Hkv, D]`` of the query's
    dtype (no float8 cache) with a power-of-two ``block_size >= 16`` (one TMA box a block;
    16 to 256 run on the H200). Which calls are prefill-heavy enough to want it is the
    caller's choice."""
    return (key_cache.dim() == 4 and _block_size_taken(key_cache.shape[1])
            and covers(query, key_cache, value_cache, lambda_full, scale, window_left, softcap, alibi_slopes,
                       scale_softcap))


def _block_size_taken(block_size: int) -> bool:
    """A cache block the kernel reads as one TMA box: a power of two >= 16."""
    return block_size >= 16 and block_size & (block_size - 1) == 0


def varlen_prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                   lambda_full: Tensor | None = None, scale: float | None = None, causal: bool = True,
                   window_right: int = -1, *, out: Tensor | None = None, tiles: GluonTiles | None = None) -> Tensor:
    """``flash_attn_varlen_func`` semantics (bottom-right causal or a right window), plain or
    fused differential, through :func:`.gluon_prefill_kernel.gluon_prefill_kernel`
    (FlashAttention-3's forward, Shah et al. 2024, arXiv 2407.08608; differential attention
    ``softmax(q1 k1) v - lambda softmax(q2 k2) v`` per head pair, Ye et al. 2024, arXiv
    2410.05258, eq. 1, without the op's ``subln`` norm, as ``ops.varlen_attention``).

    Args:
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]``: fp16/bf16 CUDA tensors on an sm90 GPU
            (H100/H200; a Triton with Gluon), D 64 or 128 (:func:`covers`; differential:
            heads ``2j``, ``2j + 1`` are pair ``j``).
        cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` int32, well formed (checked as the op does:
            eagerly, not while tracing or capturing a CUDA graph, nor with
            ``COMPILED_ATTN_CHECK_VALUES=0``; unlike the op, ``k`` and ``v`` may hold rows
            past ``cu_seqlens_k[-1]``, never read).
        lambda_full: float ``[]`` or ``[Hq / 2]`` (fp16, bf16 or fp32; read as fp32): differential;
            ``None``: plain.
        scale: softmax scale (a float), default ``D ** -0.5``.
        causal: bottom-right aligned causal mask (``window_right`` is then ignored, as
            flash-attn's causal sets the right window to 0); otherwise ``window_right`` keys
            past the diagonal (-1: all).
        out: optional ``[Tq, Hq, D]`` (differential ``[Tq, Hq / 2, 2D]``) buffer on q's
            device, q's dtype, heads and dims dense, its token stride at least a row and
            16-byte aligned, its address too (a TMA store writes it).
        tiles: default :func:`default_tiles`.

    Returns:
        ``out``.

    Raises:
        ValueError: shapes the op refuses (``validation.check_varlen_args``, and
            ``check_paged_args`` for :func:`paged_prefill`), malformed metadata (as the
            op: ``value_checks``), a scale not finite and > 0, ``window_right`` below -1,
            tensors on different devices or ``q`` not on an sm90 CUDA GPU, an ``out`` of
            another shape or dtype, tensors the kernel cannot read or write
            (:func:`launch_problem`) or tiles it does not run (:func:`_validate_tiles`),
            before any launch.
        TypeError: tensors that are not tensors, dtypes (q not fp16/bf16, k and v or the
            caches not q's, metadata not int32), ``causal`` not a bool, ``window_right`` not
            an int, ``scale`` not a float or None, ``tiles`` not a :class:`GluonTiles` or its
            fields not ints and bools, before any launch.
    """
    _check_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, None, lambda_full, scale, causal, window_right, out, tiles)
    return launch(q, k, v, cu_seqlens_q, cu_seqlens_k, None, lambda_full, scale, causal, window_right, out, tiles)


def paged_prefill(query: Tensor, key_cache: Tensor, value_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                  block_table: Tensor, lambda_full: Tensor | None = None, scale: float | None = None,
                  causal: bool = True, window_right: int = -1, *, out: Tensor | None = None,
                  tiles: GluonTiles | None = None) -> Tensor:
    """``paged_attention`` prefill (chunked prefill, prefix hits) through the Gluon kernel:
    keys from caches ``[num_blocks, block_size, Hkv, D]`` (``block_size`` a power of two >=
    16: :func:`covers_paged`) through ``block_table`` ``[B, max_blocks]`` int32,
    ``seq_lens[b]`` (int32 ``[B]``) keys of sequence ``b``, its new tokens included, causal
    bottom-right aligned; no slot past ``seq_lens[b]`` is read into the result (a cache may
    hold NaN there; ``seq_lens`` and the block ids a sequence reads are checked as the op
    checks them). Other arguments (``tiles``: :data:`PAGED_TILES` or
    :data:`DIFFERENTIAL_TILES` by default), the result and the errors as
    :func:`varlen_prefill`."""
    args = (query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full, scale)
    _check_launch(*args, causal, window_right, out, tiles)
    return launch(*args, causal, window_right, out, tiles)


@functools.cache
def _box_layout(box_rows: int, box_cols: int, dtype: torch.dtype):
    """The shared-memory layout of a TMA box ``[box_rows, box_cols]`` of fp16/bf16 (Gluon's
    default swizzle for it; cached: building it costs more host time than the descriptor)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([box_rows, box_cols],
                                                gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _descriptor(tensor: Tensor, rows: int, box_rows: int, box_heads: int = 1):
    """A TMA descriptor over ``tensor`` viewed as ``[rows, H * D]``, box ``[box_rows,
    box_heads * D]``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    heads, size = tensor.shape[-2:]
    box = [box_rows, box_heads * size]
    return TensorDescriptor(tensor, [rows, heads * size], [tensor.stride(-3), 1], box,
                            _box_layout(box_rows, box[1], tensor.dtype))


def default_tiles(q: Tensor, num_seqs: int, differential: bool, paged: bool) -> GluonTiles:
    """The tiles of a launch that names none: :data:`DIFFERENTIAL_TILES` at ``q``'s head
    size, :data:`PAGED_TILES`, or :data:`TILES`, claimed (``dynamic``) when its work tiles
    (``Hq * (Tq // 128 + B)``, ``q`` ``[Tq, Hq, D]``) make fewer than
    :data:`DYNAMIC_MAX_WAVES` waves of the programs (one a multiprocessor). Shapes only.
    Raises ValueError: a head size not in :data:`HEAD_SIZES`."""
    if q.shape[-1] not in HEAD_SIZES:
        raise ValueError(f"q: head size must be in {HEAD_SIZES}, got {q.shape[-1]}")
    if differential:
        return DIFFERENTIAL_TILES[q.shape[-1]]
    if paged:
        return PAGED_TILES
    work_tiles = q.shape[-2] * _num_q_tiles(q.shape[0], num_seqs, 2 * TILES.block_m)
    return TILES._replace(dynamic=work_tiles < DYNAMIC_MAX_WAVES * multiprocessor_count(q.device))


def _num_q_tiles(num_tokens: int, num_seqs: int, tile_m: int) -> int:
    """``Tq // TILE_M + B``: the varlen bound of a launch's query tiles (each sequence's last
    tile may be partial), the kernel's ``num_q_tiles``."""
    return num_tokens // tile_m + num_seqs


# shared memory a program may take on sm90 (H100/H200: 227 KiB)
SHARED_MEMORY = 227 * 1024


def _shared_bytes(tiles: GluonTiles, head_size: int, differential: bool) -> int:
    """Shared memory of the kernel's buffers (16-bit elements): two query buffers of a work
    tile's rows (``2 * block_m`` rows, or ``block_m`` of each component), ``stages`` key and
    value buffers (differential: both components' keys, values ``2D`` wide, and the
    ``[block_m, 2D]`` exchange of ``o_2``), and 1 KiB for barriers and tile posts (Triton
    3.6's sm90 compiles of ``tests/compile_sm90.py``: the buffers plus 408-464 bytes)."""
    parts = 2 if differential else 1
    elements = (4 * tiles.block_m * head_size + 2 * tiles.stages * parts * tiles.block_n * head_size
                + (tiles.block_m * 2 * head_size if differential else 0))
    return 2 * elements + 1024


def _validate_tiles(tiles: GluonTiles, head_size: int, differential: bool) -> None:
    """Tiles the kernel runs: a :class:`GluonTiles` of ints and bools (else TypeError) with
    ``block_m`` 64 (one wgmma's rows a consumer warpgroup, two a thread: lazy rescaling's
    per-warp decision), ``block_n`` 64 or 128, at least one stage, within :data:`SHARED_MEMORY`
    (:func:`_shared_bytes`); ``values_first`` and ``early_waits`` are orders of
    ``overlap``'s step (without it the kernel would ignore them), and ``early_waits`` needs
    two key/value buffers (with one, a step would wait for keys whose buffer it has not
    released). Raises ValueError otherwise."""
    if not isinstance(tiles, GluonTiles):
        raise TypeError(f"tiles must be a GluonTiles, got {type(tiles).__name__}")
    sizes, schedules = tiles[:3], tiles[3:]
    if any(isinstance(x, bool) or not isinstance(x, int) for x in sizes) or any(type(x) is not bool for x in schedules):
        raise TypeError(f"tiles: block_m, block_n and stages must be ints and the schedules bools, got {tiles}")
    if tiles.block_m != 64 or tiles.block_n not in (64, 128) or tiles.stages < 1:
        raise ValueError(f"tiles: block_m must be 64, block_n 64 or 128 and stages at least 1, got {tiles}")
    if (tiles.values_first or tiles.early_waits) and not tiles.overlap:
        raise ValueError(f"tiles: values_first and early_waits need overlap=True, got {tiles}")
    if tiles.early_waits and tiles.stages < 2:
        raise ValueError(f"tiles: early_waits needs stages >= 2, got {tiles}")
    if (shared := _shared_bytes(tiles, head_size, differential)) > SHARED_MEMORY:
        raise ValueError(f"tiles: {tiles} take {shared} bytes of shared memory at head size {head_size}"
                         f"{' (differential)' if differential else ''}, over the {SHARED_MEMORY} a program has")


def _check_launch(q, k, v, cu_seqlens_q, kv_lens, block_table, lambda_full, scale, causal, window_right, out,
                  tiles) -> None:
    """The public launchers' checks (the errors of :func:`varlen_prefill`): what the ops
    check (option types, ``validation.check_varlen_args`` / ``check_paged_args``, the
    scale), the dtypes and cache block sizes the kernel reads, ``out`` (a tensor on ``q``'s
    device, its shape, dtype and last dim: ``attention.output_buffer``),
    :func:`launch_problem`, when given ``tiles`` (:func:`_validate_tiles`; the default tiles
    are valid by construction), the device (:func:`_on_sm90`), then the metadata values as
    the ops check them (a copy to the host, skipped for metadata checked before and
    unchanged since)."""
    paged, differential = block_table is not None, lambda_full is not None
    names = ("query", "key_cache", "value_cache") if paged else ("q", "k", "v")
    check_call_options(scale, (-1, -1), 0.0, causal)
    if isinstance(window_right, bool) or not isinstance(window_right, int):
        raise TypeError(f"window_right must be an int, got {type(window_right).__name__} {window_right!r}")
    if window_right < -1:
        raise ValueError(f"window_right must be >= 0 or -1 (unbounded), got {window_right}")
    if paged:
        check_paged_args(q, k, v, cu_seqlens_q, kv_lens, block_table, lambda_full, -1, window_right, 0.0, None)
        if not _block_size_taken(k.shape[1]):
            raise ValueError(f"key_cache: block size must be a power of two >= 16, got {k.shape[1]}")
    else:
        check_varlen_args(q, k, v, cu_seqlens_q, kv_lens, lambda_full, -1, window_right, 0.0, None)
    check_scalars(default_scale(scale, q.shape[-1]), 0.0)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{names[0]} must be float16 or bfloat16 (wgmma operands), got {q.dtype}")
    if k.dtype != q.dtype:
        raise TypeError(f"{names[1]} must have {names[0]}'s dtype {q.dtype}, got {k.dtype}")
    if out is not None:
        check_tensor("out", out)
        check_same_device(**{names[0]: q, "out": out})
        output_buffer(q, differential, out)  # its shape, dtype and last dim
    if (problem := launch_problem(q, k, v, out, differential, names)) is not None:
        raise ValueError(problem)
    if tiles is not None:
        _validate_tiles(tiles, q.shape[-1], differential)
    if not _on_sm90(q):
        raise ValueError(f"{names[0]} must be a CUDA tensor on an sm90 GPU (H100/H200) with a Triton that has "
                         f"Gluon, got a tensor on {q.device}")
    if should_check(q):
        if paged:
            check_paged_values(q, k, cu_seqlens_q, kv_lens, block_table)
        else:
            check_varlen_values(q, k, cu_seqlens_q, kv_lens, keys_past_end=True)


def _on_sm90(tensor: Tensor) -> bool:
    """Whether ``tensor`` lives on an sm90 CUDA GPU and this Triton has Gluon (where the
    kernel runs)."""
    return tensor.is_cuda and is_hopper(tensor.get_device()) and gluon_available()


def launch(q, k, v, cu_seqlens_q, kv_lens, block_table, lambda_full, scale, causal, window_right, out,
           tiles) -> Tensor:
    """Build the descriptors and launch the kernel (contiguous K/V when ``block_table`` is
    ``None``, else paged caches; differential when ``lambda_full`` is given); arguments as
    :func:`varlen_prefill` / :func:`paged_prefill` (``kv_lens``: ``cu_seqlens_k`` or
    ``seq_lens``). Unchecked: the public launchers run :func:`_check_launch` first; the
    public ops (``compiled_attn.ops.varlen_attention`` / ``paged_attention``) check a call
    before dispatch, and their CUDA kernels (``attention.varlen_attention`` /
    ``paged_attention``) route it here only when :func:`covers` / :func:`covers_paged` and
    :func:`launch_problem` pass, so a call is checked once. Raw ``torch.ops.compiled_attn``
    calls (our layers', on metadata that ``metadata.build_metadata`` checked) skip the public
    checks (README): those two predicates still hold (dtypes, head sizes, whole GQA groups,
    ``v`` shaped as ``k``, dense rows, aligned addresses), the rest of the shapes
    (``cu_seqlens_k`` as long as ``cu_seqlens_q``, ``lambda_full``'s size) and the metadata
    values are the caller's."""
    differential, paged = lambda_full is not None, block_table is not None
    num_seqs = cu_seqlens_q.shape[0] - 1
    tiles = tiles or default_tiles(q, num_seqs, differential, paged)
    out = output_buffer(q, differential, out)
    num_tokens, num_heads, head_size = q.shape
    if num_tokens == 0:
        return out
    if k.shape[0] == 0:  # no key at all (a TMA descriptor needs rows): every row sees nothing
        return out.zero_()
    # the kernel reads the metadata as dense rows (no-ops for the usual contiguous tensors)
    cu_seqlens_q, kv_lens = cu_seqlens_q.contiguous(), kv_lens.contiguous()
    block_table = None if block_table is None else block_table.contiguous()
    tile_m = tiles.block_m if differential else 2 * tiles.block_m
    num_q_tiles = _num_q_tiles(num_tokens, num_seqs, tile_m)
    if paged:
        num_blocks, block_size = k.shape[:2]
        kv_rows, box = num_blocks * block_size, min(block_size, tiles.block_n)
        stride_vb, stride_vt = v.stride(0), v.stride(1)
        stride_bt = block_table.stride(0)
    else:
        block_size, kv_rows, box = 1, k.shape[0], tiles.block_n
        stride_vb, stride_vt, stride_bt = 0, v.stride(0), 0
        block_table = cu_seqlens_q  # placeholder (never read)
    min_dist = 0 if causal else (-window_right if window_right >= 0 else -UNBOUNDED)
    qk_scale = default_scale(scale, head_size) * LOG2E
    q_desc = _descriptor(q, num_tokens, tile_m)
    # (differential: unused) a pair tail's queries; the output's TMA store; both through slices of a query
    # buffer, laid out as q_desc's boxes
    q_half_desc = q_desc if differential else _descriptor(q, num_tokens, tiles.block_m)
    out_desc = q_desc if differential else _descriptor(out, num_tokens, tiles.block_m)
    assert out_desc.layout == q_half_desc.layout == q_desc.layout, (out_desc.layout, q_desc.layout)
    args = (out, out_desc, q_desc, q_half_desc, _descriptor(k, kv_rows, box),
            _descriptor(v, kv_rows, box, 1 + differential), v, cu_seqlens_q, kv_lens, block_table,
            q if lambda_full is None else lambda_full.contiguous(),  # (plain: a placeholder, never read)
            # the tiles handed out past the first wave (static schedule: a placeholder, never read)
            torch.zeros(1, dtype=torch.int32, device=q.device) if tiles.dynamic else cu_seqlens_q,
            num_seqs, num_q_tiles, qk_scale, min_dist, kv_rows, out.stride(0), stride_vb, stride_vt, stride_bt)
    constexprs = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[-2], HEAD_SIZE=head_size, BLOCK_M=tiles.block_m,
                      BLOCK_N=tiles.block_n, STAGES=tiles.stages, PAGED=paged, BLOCK_SIZE=block_size,
                      OVERLAP=tiles.overlap, PINGPONG=tiles.pingpong, VALUES_FIRST=tiles.values_first,
                      EARLY_WAITS=tiles.early_waits, LAZY_RESCALE=tiles.lazy_rescale, DIFFERENTIAL=differential,
                      LAMBDA_PER_PAIR=differential and lambda_full.numel() > 1, DYNAMIC=tiles.dynamic)
    units = num_heads // 2 if differential else num_heads
    grid = (min(units * num_q_tiles, multiprocessor_count(q.device)),)
    with device_guard(q):
        _run(grid, args, constexprs)
    return out


def _run(grid: tuple[int], args: tuple, constexprs: dict) -> None:
    """The kernel launch (one warpgroup a partition: ``num_warps=4``)."""
    from .gluon_prefill_kernel import gluon_prefill_kernel

    gluon_prefill_kernel[grid](*args, **constexprs, num_warps=4)
