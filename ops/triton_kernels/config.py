"""Launch configuration of the attention kernel, chosen from tensor shapes only.

Nothing here reads a tensor's values, so a configuration is fixed for a given set of shapes
and every launch is safe to capture in a CUDA graph. The numbers come from a sweep on an
H200 (``profiling/tile_sweep.py``, results in ``profiling/results/triton_kernels.md``):

* Query rows per program (``block_m``): enough for the batch's average query length times
  the GQA group, at least 16 (the smallest ``tl.dot`` M), at most what keeps the float32
  accumulators (per row: ``D`` plain; ``2 x 2D`` differential, softmax1 and softmax2 times
  ``[v1 | v2]``) within ``ACCUMULATOR_BUDGET``. Decode batches get 16 rows, prefill up to
  128 (64 differential), as FlashAttention-2.
* Keys per step (``tile_n``): at most ``KV_STEP_BYTES`` of K/V loads per step, 16 to 64.
* 4 warps up to 8192 accumulator floats per program, else 8; 3 pipeline stages for steps of
  up to 32 KiB, else 2 (shared memory).
* Flash-decoding splits (:func:`choose_num_splits`) when the grid is too small to keep
  ``IN_FLIGHT_BYTES`` of K/V requested per multiprocessor.
"""

from dataclasses import dataclass

import torch
import triton

from .launch_utils import next_power_of_2

MIN_BLOCK_M = 16  # smallest M (and N, K) of tl.dot
MAX_BLOCK_M = 128
ACCUMULATOR_BUDGET = 32768  # float32 accumulator elements per program (128 a thread at 8 warps)
KV_STEP_BYTES = 65536  # K/V bytes loaded per key step, at most
IN_FLIGHT_BYTES = 262144  # K/V bytes per SM the split heuristic keeps requested
MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 256


@dataclass(frozen=True)
class TileConfig:
    """``block_m`` query rows (``block_m // group_pad`` tokens x ``group_pad`` heads) against
    ``tile_n`` keys per step; ``num_warps`` and ``num_stages`` as Triton's launch options;
    ``programs_per_sm``: resident programs that keep ``IN_FLIGHT_BYTES`` requested."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int


def choose_tiles(num_tokens: int, num_seqs: int, group_pad: int, head_size_pad: int,
                 differential: bool, dtype: torch.dtype) -> TileConfig:
    """Tiles for a batch of ``num_tokens`` queries in ``num_seqs`` sequences, ``group_pad``
    query heads (pairs) per KV head (pair), head size padded to ``head_size_pad``."""
    state = 4 if differential else 1  # float32 accumulator columns per row, in head sizes
    operand = 4 if dtype == torch.float32 else 1  # float32 operands: more registers and smem
    max_block_m = ACCUMULATOR_BUDGET // (head_size_pad * state * operand)
    max_block_m = max(MIN_BLOCK_M, min(MAX_BLOCK_M, max_block_m))
    rows_per_seq = triton.cdiv(num_tokens, max(num_seqs, 1)) * group_pad
    block_m = max(MIN_BLOCK_M, group_pad, min(next_power_of_2(rows_per_seq), max_block_m))
    kv_loads = 4 if differential else 2  # k, v tiles (k1, k2 and the [v1 | v2] pair)
    token_bytes = head_size_pad * dtype.itemsize * kv_loads
    tile_n = max(16, min(64, KV_STEP_BYTES // token_bytes))
    step_bytes = tile_n * token_bytes
    accumulators = block_m * head_size_pad * state * operand
    return TileConfig(block_m, tile_n, num_warps=4 if accumulators <= 8192 else 8,
                      num_stages=3 if step_bytes <= 32768 else 2,
                      programs_per_sm=triton.cdiv(IN_FLIGHT_BYTES, step_bytes))


def choose_num_splits(num_seqs: int, num_tokens: int, block_q: int, num_kv_units: int,
                      max_kv_len: int, programs_per_sm: int, num_sms: int) -> int:
    """Flash-decoding splits of each query tile's key range.

    ``max_kv_len`` bounds the keys of any sequence (block-table width x block size, or the
    total key count). Splits are added only while the grid has fewer than
    ``programs_per_sm`` programs per multiprocessor, and never below ``MIN_KEYS_PER_SPLIT``
    keys per split of the longest possible sequence.
    """
    busy = max(num_seqs, triton.cdiv(num_tokens, block_q)) * num_kv_units
    wanted = triton.cdiv(programs_per_sm * num_sms, max(busy, 1))
    return max(1, min(wanted, triton.cdiv(max_kv_len, MIN_KEYS_PER_SPLIT), MAX_SPLITS))
