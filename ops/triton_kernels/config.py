"""Launch configuration of the attention kernel, chosen from tensor shapes only.

Nothing here reads a tensor's values, so a configuration is fixed for a given set of shapes
and every launch is safe to capture in a CUDA graph. Two regimes:

* decode-like batches (few query rows per sequence and KV head): ``BLOCK_M = 16`` rows, the
  smallest ``tl.dot`` tile, wide key tiles to stream the cache; and, when the grid is too
  small to fill the GPU, flash-decoding splits of the key range (:func:`choose_num_splits`);
* prefill-like batches: up to 128 query rows per program (64 for head size 256,
  differential or float32, which hold more state per row), as FlashAttention-2.
"""

from dataclasses import dataclass

import torch
import triton

from .launch_utils import next_power_of_2

MIN_BLOCK_M = 16  # smallest M of tl.dot
MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 256
PROGRAMS_PER_SM = 4  # resident 4-warp programs per SM that keep enough loads in flight


@dataclass(frozen=True)
class TileConfig:
    """``block_m`` query rows (``block_m // group_pad`` tokens x ``group_pad`` heads) against
    ``tile_n`` keys per step; ``num_warps`` and ``num_stages`` as Triton's launch options."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int


def choose_tiles(num_tokens: int, num_seqs: int, group_pad: int, head_size_pad: int,
                 differential: bool, dtype: torch.dtype) -> TileConfig:
    """Tiles for a batch of ``num_tokens`` queries in ``num_seqs`` sequences, ``group_pad``
    query heads (pairs) per KV head (pair), head size padded to ``head_size_pad``."""
    wide_state = differential or head_size_pad > 128 or dtype == torch.float32
    max_block_m = 64 if wide_state else 128
    rows_per_seq = triton.cdiv(num_tokens, max(num_seqs, 1)) * group_pad
    block_m = max(MIN_BLOCK_M, group_pad, min(next_power_of_2(rows_per_seq), max_block_m))
    if block_m <= 32:  # decode: stream the cache
        tile_n = 32 if wide_state else 64
        return TileConfig(block_m, tile_n, num_warps=4, num_stages=3)
    tile_n = 32 if head_size_pad > 128 or dtype == torch.float32 else 64
    return TileConfig(block_m, tile_n, num_warps=8 if block_m >= 128 or wide_state else 4,
                      num_stages=2)


def choose_num_splits(num_seqs: int, num_tokens: int, block_q: int, num_kv_units: int,
                      max_kv_len: int, num_sms: int) -> int:
    """Flash-decoding splits of each query tile's key range.

    ``max_kv_len`` bounds the keys of any sequence (block-table width x block size, or the
    total key count). Splits are added only while the grid has fewer programs than
    ``PROGRAMS_PER_SM`` per multiprocessor, and never below ``MIN_KEYS_PER_SPLIT`` keys
    per split of the longest possible sequence.
    """
    busy = max(num_seqs, triton.cdiv(num_tokens, block_q)) * num_kv_units
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(busy, 1))
    return max(1, min(wanted, triton.cdiv(max_kv_len, MIN_KEYS_PER_SPLIT), MAX_SPLITS))
