"""Host side of the Hopper prefill kernel (:mod:`.prefill_kernel`): its tiles, which calls
it serves, and its launchers.

* :class:`PrefillTiles` and the tile tables: :data:`HOPPER_TILES` (K/V through TMA),
  :data:`PAGED_TILES` (K/V by pointer loads: paged caches, or contiguous K/V without TMA),
  the sweeps' alternatives (:data:`SWEEP_TILES`, :data:`PAGED_SWEEP_TILES`) and
  :func:`choose_prefill_tiles`;
* :func:`covers` / :func:`covers_paged`: the ``varlen_attention`` / ``paged_attention``
  calls the kernel serves (``attention.PREFILL_KERNEL`` / ``PAGED_PREFILL_KERNEL`` route
  them here), from shapes and dtypes only;
* :func:`varlen_prefill` (contiguous ``q``/``k``/``v``) and :func:`paged_prefill` (paged
  caches through the block table), both through one launch path (``_prefill``): launch
  specs cached by shapes, strides and flags, TMA on where every tensor is
  :func:`tma_ready` on an sm90+ GPU, Triton's global-scratch allocator for the device-side
  descriptors (:func:`ensure_triton_allocator`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from ..attention import default_scale, output_buffer
from .launch_utils import BoundedCache, CachedLauncher, device_guard, tracing_launches
from .prefill_kernel import UNBOUNDED, prefill_kernel


class PrefillTiles(NamedTuple):
    """``block_m`` query tokens x ``block_n`` keys per step; Triton launch options;
    ``value_split`` (differential): one program per value head of a pair (see
    :func:`prefill_kernel`'s ``VALUE_SPLIT``); ``overlap``: the previous key tile's ``p v``
    product left in flight while this one's softmax runs (``OVERLAP``); ``sequential``
    (differential, not with ``value_split``): one program per pair runs the two softmax
    components one after the other, each over the whole ``[v1 | v2]`` values
    (``SEQUENTIAL``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    value_split: bool = False
    overlap: bool = False
    sequential: bool = False

    def label(self) -> str:
        """``128x64 w8 s3`` with `` split`` / `` overlap`` / `` sequential`` where set
        (benchmark rows)."""
        return (f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"
                + " split" * self.value_split + " overlap" * self.overlap + " sequential" * self.sequential)


# Hopper tiles (bf16/fp16) for K/V through TMA (contiguous), by (head size, differential);
# registers a thread and shared memory from ptxas on sm90 with Triton 3.6
# (tests/compile_prefill_sm90.py). Float32 accumulators per program: plain block_m x D;
# differential 2 x block_m x 2D, with value_split 2 x block_m x D, sequential block_m x 2D
# (at 8 warps 32768 floats are 128 registers a thread). A differential 64-row tile (D 128
# unsplit, not sequential) makes Triton replicate the score dot across both warpgroups (mma
# warpsPerCTA [8, 1] over 64 rows) and spills: avoided. D 128 chosen on the H200 (2026-12-01, bf16, causal, Hq 32,
# Hkv 8; profiling/bench_kernels.py --parts prefill; ms at B=8 S=2048 / 64 sequences of
# 128-4096 tokens): plain 128x128 w8 s3 0.755 / 8.27 against the unified kernel's
# 0.812 / 9.08 (128x128 w8 s2, the former default, 0.822 / 9.25; 64x64 w4 s3 0.728 / 8.58,
# faster at B=8 S=2048 only). Differential D 128 (second run of the day): 128x64 w8 s3
# sequential 0.929 / 11.02 against the former default 128x64 w8 s2 split's 1.440 / 16.38
# and the unified kernel's 1.667 / 18.73 (flash-attn 4's two calls alone, no combine,
# 0.987 / 11.42 in the same session). D 64 and 256: not timed yet.
HOPPER_TILES: dict[tuple[int, bool], PrefillTiles] = {
    (64, False): PrefillTiles(128, 128, 8, 3),  # 211 registers, 113 KiB shared
    (128, False): PrefillTiles(128, 128, 8, 3),  # 233 registers, 225 KiB (of 227)
    (256, False): PrefillTiles(128, 32, 8, 2),  # 198 registers, 128 KiB
    (64, True): PrefillTiles(128, 32, 8, 3),  # 216 registers, 81 KiB
    (128, True): PrefillTiles(128, 64, 8, 3, sequential=True),  # 252 registers, 177 KiB
}
# Alternatives the benchmark times against HOPPER_TILES (the former defaults among them);
# ms as above, the last run's (unified 0.812 / 9.08 plain) or, marked ``first``, the day's
# first sweep's (unified 0.806 / 9.02 plain, 1.666 / 18.6 differential).
# ``overlap`` tiles (FlashAttention-3's softmax / ``p v`` overlap, :func:`prefill_kernel`'s
# ``OVERLAP``; sm90 offline with Triton 3.6: none spilling, none with serialized wgmma,
# tests/compile_prefill_sm90.py) lost everywhere on the H200 (2026-12-01, second run):
# plain D 128 0.86-0.87 / 9.6-9.7 ms at 128 rows against 0.758 / 8.26 for the default, and
# 5-20% slower than the same tiles without it elsewhere. ``sequential`` tiles: the
# differential D 128 rows above (all eight between 0.93 and 1.21 ms at B=8 S=2048).
SWEEP_TILES: dict[tuple[int, bool], tuple[PrefillTiles, ...]] = {
    (64, False): (PrefillTiles(128, 64, 4, 3), PrefillTiles(128, 64, 8, 4),
                  PrefillTiles(128, 128, 8, 3, overlap=True),  # 225 registers, 128 KiB
                  PrefillTiles(128, 64, 8, 3, overlap=True)),  # 129 registers, 72 KiB
    (128, False): (PrefillTiles(128, 128, 8, 2),  # 0.822 / 9.25 ms
                   PrefillTiles(128, 64, 8, 3),  # first 0.776 / 8.61
                   PrefillTiles(64, 64, 4, 3),  # 0.728 / 8.58
                   PrefillTiles(128, 128, 8, 2, overlap=True),  # 249 registers, 192 KiB
                   PrefillTiles(128, 64, 8, 3, overlap=True),  # 169 registers, 144 KiB
                   PrefillTiles(128, 64, 8, 4, overlap=True),  # 169 registers, 176 KiB
                   # one warpgroup a program, 2-4 programs a multiprocessor (by shared memory)
                   PrefillTiles(64, 64, 4, 2),  # 148 registers, 81 KiB
                   PrefillTiles(64, 64, 4, 2, overlap=True),  # 171 registers, 96 KiB
                   PrefillTiles(64, 32, 4, 3),  # 122 registers, 65 KiB
                   PrefillTiles(64, 32, 4, 3, overlap=True),  # 127 registers, 72 KiB
                   PrefillTiles(64, 32, 4, 2)),  # 116 registers, 48 KiB
    (256, False): (PrefillTiles(128, 64, 8, 2), PrefillTiles(64, 64, 4, 2),
                   PrefillTiles(128, 32, 8, 2, overlap=True)),  # 215 registers, 144 KiB
    (64, True): (PrefillTiles(128, 64, 8, 3, value_split=True), PrefillTiles(64, 64, 4, 3),
                 PrefillTiles(128, 32, 8, 3, overlap=True),  # 251 registers, 88 KiB
                 PrefillTiles(128, 64, 8, 3, value_split=True, overlap=True),  # 251 registers, 112 KiB
                 PrefillTiles(128, 128, 8, 2, sequential=True),  # 246 registers, 113 KiB
                 PrefillTiles(128, 64, 8, 3, sequential=True)),  # 192 registers, 89 KiB
    # the former default, 1.440 / 16.38 ms (255 registers and a small spill with Triton 3.6:
    # 44 bytes stored, 84 loaded a thread; none with 3.9)
    (128, True): (PrefillTiles(128, 64, 8, 2, value_split=True),  # 160 KiB
                  PrefillTiles(128, 32, 8, 3, value_split=True),  # first 1.660 / 19.14 ms
                  PrefillTiles(64, 64, 8, 2),  # first 1.555 / 17.98
                  PrefillTiles(64, 32, 8, 3),  # first 1.892 / 21.62
                  PrefillTiles(128, 32, 8, 3, value_split=True, overlap=True),  # 255 registers, 144 KiB
                  PrefillTiles(128, 32, 8, 2, value_split=True, overlap=True),  # 255 registers, 120 KiB
                  PrefillTiles(128, 64, 8, 2, sequential=True),  # 0.978 / 11.40; 129 KiB
                  PrefillTiles(128, 32, 8, 3, sequential=True),  # 1.074 / 12.38; 4 B spilled, 105 KiB
                  PrefillTiles(128, 32, 8, 3, overlap=True, sequential=True),  # 1.205 / 13.86; 120 KiB
                  PrefillTiles(64, 64, 4, 2, sequential=True),  # 0.944 / 12.04; 113 KiB
                  PrefillTiles(64, 32, 4, 3, sequential=True),  # 1.025 / 12.35; 89 KiB
                  PrefillTiles(64, 32, 4, 2, overlap=True, sequential=True),  # 1.129 / 13.31; 80 KiB
                  PrefillTiles(64, 32, 4, 2, sequential=True)),  # 1.177 / 13.71; 65 KiB
}
# Tiles of K/V read by pointer loads: paged prefill (chunked prefill over a paged cache)
# and contiguous K/V without TMA (not tma_ready, or a GPU before sm90). ``PAGED`` reads each
# key tile's BLOCK_N // block_size block ids once and loads K/V rows with pointer loads,
# which Triton pipelines as cp.async straight into the swizzled shared buffers that wgmma
# reads (no register copy; at 3+ stages the id load itself is pipelined a stage ahead);
# q and out through TMA. (TMA for K/V would need one [block_size, D] box per block: Triton
# 3.6 then copies each box shared -> registers, joins them and stores the tile back to shared
# for wgmma, and the dots turn synchronous; TMA gather is sm100 only.) The former
# HOPPER_TILES, all spill-free for sm90 at block 16 (tests/compile_prefill_sm90.py: plain
# D 128 243 registers, 160 KiB). On the H200 (2026-12-01, B=8, 512 new tokens after 4096
# cached, block 16, plain D 128, before RAW_MAX reached this path): paged 0.830 ms against
# the unified kernel's 1.169 and contiguous 128x128 w8 s2's 0.720 (paged / contiguous
# 1.15-1.17, target <= 1.1); profiling/bench_kernels.py --parts prefill times
# PAGED_SWEEP_TILES (spill-free too). Apart from HOPPER_TILES: the paged path was timed at
# these, and the D 128 TMA defaults fit pointer loads worse (sm90 offline, contiguous K/V
# without TMA: 224 KiB of shared memory plain, 208 bytes spilled differential).
PAGED_TILES: dict[tuple[int, bool], PrefillTiles] = {
    (64, False): PrefillTiles(128, 128, 8, 3),
    (128, False): PrefillTiles(128, 128, 8, 2),
    (256, False): PrefillTiles(128, 32, 8, 2),
    (64, True): PrefillTiles(128, 32, 8, 3),
    (128, True): PrefillTiles(128, 32, 8, 3, value_split=True),
}
PAGED_SWEEP_TILES: dict[tuple[int, bool], tuple[PrefillTiles, ...]] = {
    (64, False): (PrefillTiles(128, 64, 8, 3), PrefillTiles(128, 128, 8, 2),
                  PrefillTiles(128, 64, 8, 3, overlap=True)),  # 184 registers, 56 KiB
    (128, False): (PrefillTiles(128, 128, 8, 3), PrefillTiles(128, 64, 8, 3), PrefillTiles(64, 64, 4, 3),
                   PrefillTiles(128, 64, 8, 3, overlap=True),  # 216 registers, 112 KiB
                   PrefillTiles(64, 64, 4, 2)),  # 222 registers, 80 KiB
    (256, False): (PrefillTiles(128, 32, 8, 3),),
    (64, True): (PrefillTiles(128, 64, 8, 3, value_split=True), PrefillTiles(128, 32, 8, 2),
                 PrefillTiles(128, 64, 8, 3, sequential=True)),  # 251 registers, 65 KiB
    # B=8, 512 new after 4096 cached, block 16 (H200, 2026-12-01): the default 1.922 ms, 128x32 w8 s2
    # split 2.011, 64x32 w4 s2 split 1.646, 128x32 w8 s3 sequential 1.591 (the unified kernel
    # 2.105); the sequential tile's GPU test did not finish that session: not the default yet
    (128, True): (PrefillTiles(128, 32, 8, 2, value_split=True), PrefillTiles(64, 32, 4, 2, value_split=True),
                  PrefillTiles(128, 32, 8, 3, sequential=True)),  # 255 registers (8 B spilled), 80 KiB
}
INTERPRETER_TILES = PrefillTiles(16, 16, 4, 1)  # CPU tensors (the interpreter): small tiles
MAX_GRID_Y = 65535  # CUDA's limit on grid axis 1 (the query tiles)


def covers(q: Tensor, k: Tensor, v: Tensor, lambda_full: Tensor | None, alibi_slopes: Tensor | None) -> bool:
    """Whether :func:`varlen_prefill` serves this ``varlen_attention`` call on a GPU:
    fp16/bf16, head sizes in :data:`HOPPER_TILES`, no ALiBi, a grid within CUDA's limits
    (at either table's tiles: :func:`choose_prefill_tiles`). Reads shapes and dtypes only."""
    if alibi_slopes is not None or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if k.dtype != q.dtype or v.dtype != q.dtype or k.shape[-1] != q.shape[-1]:
        return False
    key = (q.shape[-1], lambda_full is not None)
    if key not in HOPPER_TILES:
        return False
    block_m = min(HOPPER_TILES[key].block_m, PAGED_TILES[key].block_m)
    return q.shape[0] // block_m + 1 <= MAX_GRID_Y


def choose_prefill_tiles(head_size: int, differential: bool, dtype: torch.dtype, on_gpu: bool,
                         kv_tma: bool) -> PrefillTiles:
    """Tiles from shapes only: on a GPU :data:`HOPPER_TILES` when K/V go through TMA
    (``kv_tma``), else :data:`PAGED_TILES` (K/V by pointer loads: paged caches, or
    contiguous K/V without TMA); small tiles on the CPU."""
    if not on_gpu:
        return INTERPRETER_TILES
    tiles = (HOPPER_TILES if kv_tma else PAGED_TILES).get((head_size, differential))
    if tiles is None or dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"no Hopper prefill tiles for head size {head_size}, differential={differential}, "
                         f"{dtype}; check covers() first")
    return tiles


def tma_ready(tensor: Tensor, head_size: int) -> bool:
    """Whether ``tensor`` ``[T, H, D]`` can be read or written through a TMA descriptor over
    its ``[T, H * D]`` view: heads and dims dense, token stride and base address multiples
    of 16 bytes (so is every sequence's first token)."""
    size = tensor.element_size()
    if tracing_launches():  # no addresses: the offset into an (aligned) allocation
        aligned = (tensor.storage_offset() * size) % 16 == 0
    else:
        aligned = tensor.data_ptr() % 16 == 0
    return tensor.stride(2) == 1 and tensor.stride(1) == head_size and (tensor.stride(0) * size) % 16 == 0 and aligned


@functools.cache
def _has_tma(index: int) -> bool:
    """Whether CUDA device ``index`` is an NVIDIA GPU of sm90 or newer (TMA tensor descriptors)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def is_hopper(index: int) -> bool:
    """Whether CUDA device ``index`` is an NVIDIA sm90 GPU (H100/H200): what the tiles here
    are sized for (up to 227 KiB of shared memory a program; sm120 GPUs have 99 KiB, ROCm's
    MI300, which PyTorch reports as capability 9.4, 64 KiB) and timed on, and so where the op
    routes covered prefills to this kernel (``attention.prefill_kernel_serves``)."""
    return (torch.version.hip is None and index >= 0 and torch.cuda.is_available()
            and torch.cuda.get_device_capability(index)[0] == 9)


def _torch_scratch(size: int, alignment: int, stream) -> Tensor:
    """Triton's global-scratch allocator (device-side TMA descriptors live there)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_triton_allocator() -> None:
    """Set Triton's scratch allocator in this context if none is set (a kernel that builds
    tensor descriptors on the device needs 128 bytes of global scratch a program; Inductor
    sets its own before launching a traced kernel). The allocation comes from PyTorch's
    caching allocator on the current stream, so it is captured by CUDA graphs as any
    other allocation."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


_PREFILL = CachedLauncher(prefill_kernel)
_SPECS: BoundedCache = BoundedCache()


class _Spec(NamedTuple):
    grid: tuple[int, int, int]
    int_args: tuple[int, ...]
    constexprs: dict
    options: dict


def varlen_prefill(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    lambda_full: Tensor | None = None, scale: float | None = None, causal: bool = True,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    alibi_slopes: Tensor | None = None, scale_softcap: Tensor | None = None, *,
    out: Tensor | None = None, tiles: PrefillTiles | None = None, use_tma: bool | None = None,
) -> Tensor:
    """``compiled_attn::varlen_attention`` (arguments as :func:`.attention.varlen_attention`)
    through :func:`prefill_kernel`: plain or fused differential, causal or not, windows,
    softcap (a float or the ``scale_softcap`` tensor), GQA. No ALiBi (use the unified
    kernel: :func:`covers`).

    Args:
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]`` (heads interleaved in pairs when
            differential); cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` int32.
        lambda_full: ``[]`` or ``[Hq/2]``: differential; ``None``: plain.
        out: optional output buffer (``[Tq, Hq, D]`` or ``[Tq, Hq/2, 2D]``, q's dtype, last
            dim contiguous).
        tiles: override :func:`choose_prefill_tiles` (tests, tile sweeps; default on a GPU:
            :data:`HOPPER_TILES` with TMA, else :data:`PAGED_TILES`).
        use_tma: force TMA descriptors on (``True``, q, k, v and out must pass
            :func:`tma_ready`) or off; default: on for CUDA tensors of an sm90+ GPU that
            pass it, off for CPU tensors (the interpreter tests force it on).

    Returns:
        ``out``.
    """
    if alibi_slopes is not None:
        raise ValueError("varlen_prefill has no ALiBi: use the unified kernel (varlen_attention)")
    return _prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, None, lambda_full, scale, causal, window_left, window_right,
                    softcap, scale_softcap, out, tiles, use_tma)


def covers_paged(query: Tensor, key_cache: Tensor, value_cache: Tensor, num_seqs: int,
                 lambda_full: Tensor | None, alibi_slopes: Tensor | None) -> bool:
    """Whether :func:`paged_prefill` serves this ``paged_attention`` call on a GPU: what
    :func:`covers` takes (fp16/bf16 caches of the query's dtype, so no float8 cache; head
    sizes of :data:`PAGED_TILES`; no ALiBi), a power-of-two block size, and query runs of at
    least one query tile on average: ``T >= block_m * B`` (chunked prefill, prefix hits; a
    decode step or a batch of mostly decode rows stays on the unified kernel, which packs a
    GQA group's rows into one tile where this kernel would spend a ``block_m``-row tile per
    query head on each one-token row). Reads shapes and dtypes only."""
    if not covers(query, key_cache, value_cache, lambda_full, alibi_slopes) or key_cache.dim() != 4:
        return False
    tiles = PAGED_TILES.get((query.shape[-1], lambda_full is not None))
    block_size = key_cache.shape[1]
    num_tokens = query.shape[0]
    return (tiles is not None and block_size > 0 and block_size & (block_size - 1) == 0
            and num_tokens >= tiles.block_m * max(num_seqs, 1)
            and num_tokens // tiles.block_m + num_seqs <= MAX_GRID_Y)


def paged_prefill(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
    block_table: Tensor, lambda_full: Tensor | None = None, scale: float | None = None, causal: bool = True,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    scale_softcap: Tensor | None = None, *, out: Tensor | None = None, tiles: PrefillTiles | None = None,
    use_tma: bool | None = None,
) -> Tensor:
    """``compiled_attn::paged_attention`` (arguments as :func:`.attention.paged_attention`)
    through :func:`prefill_kernel` with ``PAGED``: K/V from caches ``[num_blocks,
    block_size, Hkv, D]`` (query's dtype, power-of-two ``block_size``) through
    ``block_table`` ``[B, max_blocks]`` int32, ``seq_lens[b]`` keys of sequence ``b`` (its
    new tokens included, causal bottom-right aligned). ``tiles``: default
    :data:`PAGED_TILES` on a GPU; ``use_tma``: TMA for q and out (K/V always pointer loads).
    No ALiBi, no float8 cache (:func:`covers_paged`)."""
    if alibi_slopes is not None or key_cache.dtype != query.dtype:
        raise ValueError("paged_prefill has no ALiBi and no float8 cache: use the unified kernel (paged_attention)")
    block_size = key_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"paged_prefill needs a power-of-two block size, got {block_size}")
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    return _prefill(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, lambda_full, scale, causal,
                    window_left, window_right, softcap, scale_softcap, out, tiles, use_tma)


def _prefill(q, k, v, cu_seqlens_q, kv_lens, block_table, lambda_full, scale, causal, window_left, window_right,
             softcap, scale_softcap, out, tiles, use_tma) -> Tensor:
    """Launch :func:`prefill_kernel`: contiguous ``k``/``v`` with ``kv_lens =
    cu_seqlens_k`` (``block_table is None``), or paged caches with ``kv_lens = seq_lens``."""
    paged = block_table is not None
    differential = lambda_full is not None
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = k.shape[-2]
    out = output_buffer(q, differential, out)
    if num_tokens == 0:
        return out
    if head_size & (head_size - 1) or head_size < 16:
        raise ValueError(f"the prefill kernel needs a power-of-two head size >= 16, got {head_size}")
    on_gpu = q.is_cuda
    if use_tma is None:
        tma_tensors = (q,) if paged else (q, k, v)  # paged K/V: pointer loads
        use_tma = (on_gpu and _has_tma(q.get_device()) and all(tma_ready(t, head_size) for t in tma_tensors)
                   and tma_ready(out, out.shape[-1]))
    kv_tma = use_tma and not paged
    tiles = tiles or choose_prefill_tiles(head_size, differential, q.dtype, on_gpu, kv_tma)
    scale = default_scale(scale, head_size)
    cu_seqlens_q, kv_lens = cu_seqlens_q.contiguous(), kv_lens.contiguous()
    lambda_full = None if lambda_full is None else lambda_full.contiguous()
    num_seqs = cu_seqlens_q.shape[0] - 1
    if causal:
        min_dist = 0
    else:
        min_dist = -window_right if window_right >= 0 else -UNBOUNDED
    max_dist = window_left if window_left >= 0 else UNBOUNDED
    window = window_left >= 0
    key = (q.shape, q.stride(), k.shape[1:], k.stride(), v.stride(), out.stride(), q.dtype, num_seqs,
           None if lambda_full is None else lambda_full.numel(), softcap > 0, scale_softcap is None, scale > 0,
           window, tiles, use_tma, q.get_device(),
           None if block_table is None else (block_table.shape, block_table.stride()))
    spec = _SPECS.get(key)
    if spec is None:  # the tiles are in the key: checked once per launch spec
        if tiles.value_split and tiles.sequential:
            raise ValueError(f"tiles: value_split and sequential exclude each other, got {tiles}")
        constexprs = dict(
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, DIFFERENTIAL=differential,
            LAMBDA_PER_PAIR=differential and lambda_full.numel() > 1,
            SOFTCAP=softcap > 0 or scale_softcap is not None, RUNTIME_SCALARS=scale_softcap is not None,
            WINDOW_LEFT=window, USE_TMA=use_tma, VALUE_SPLIT=differential and tiles.value_split,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, PAGED=paged, BLOCK_SIZE=k.shape[1] if paged else 1,
            RAW_MAX=softcap <= 0 and scale_softcap is None and scale > 0, OVERLAP=tiles.overlap,
            SEQUENTIAL=differential and tiles.sequential)
        units = (num_heads if tiles.value_split else num_heads // 2) if differential else num_heads
        # strides: q; k and v as (block, token or slot, head, dim) (block 0 when contiguous); out; table row
        k_strides = k.stride() if paged else (0, *k.stride())
        v_strides = v.stride() if paged else (0, *v.stride())
        spec = _SPECS[key] = _Spec(
            grid=(units, num_tokens // tiles.block_m + num_seqs, 1),
            int_args=(*q.stride(), *k_strides, *v_strides, *out.stride(), block_table.stride(0) if paged else 0),
            constexprs=constexprs, options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    if use_tma and on_gpu and not tracing_launches():
        ensure_triton_allocator()
    placeholder = q  # pointer arguments of disabled features (never read)
    args = (out, q, k, v, cu_seqlens_q, kv_lens, placeholder if block_table is None else block_table,
            placeholder if lambda_full is None else lambda_full,
            placeholder if scale_softcap is None else scale_softcap, num_seqs, float(scale), float(softcap),
            min_dist, max_dist, *spec.int_args)
    with device_guard(q):
        # The key holds every specialization (strides, flags, tiles); alignments too.
        _PREFILL((key, tuple(t.data_ptr() % 16 for t in args[:9]) if not tracing_launches() else ()),
                 spec.grid, args, q.get_device(), lambda: (spec.constexprs, spec.options))
    return out
