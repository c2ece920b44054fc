"""Launch configuration of the attention kernel, chosen from tensor shapes only.

Nothing here reads a tensor's values, so a configuration is fixed for a given set of shapes
and every launch is safe to capture in a CUDA graph. The numbers come from a sweep on an
H200 (``profiling/tile_sweep.py``, results in ``profiling/results/triton_kernels.md``):

* Query rows per program (``block_m``): enough for the batch's average query length times
  the GQA group, at least 16 (the smallest ``tl.dot`` M), at most what keeps the float32
  accumulators (per row: ``D`` plain; ``2 x 2D`` differential, softmax1 and softmax2 times
  ``[v1 | v2]``) within ``ACCUMULATOR_BUDGET``. Decode batches get 16 rows, prefill up to
  128 (64 differential), as FlashAttention-2.
* Differential decode tiles whose rows (tokens x pairs) fill at most half of the 16-row
  minimum are *stacked* (q1 rows over q2 rows, see :mod:`.attention_kernel`): one
  ``2D``-wide accumulator per row instead of two.
* Keys per step (``tile_n``): at most ``KV_STEP_BYTES`` of K/V loads per step, 16 to 64;
  differential prefill tiles (64 rows or more) take twice that, up to 128 keys, unpipelined.
* Differential launches of short chunks (at most ``SHORT_CHUNK_TOKENS`` tokens a sequence:
  the suffix of a prefix hit, the mixed steps of a serving engine) with heads of up to 64
  take at most 64 rows and pipelined 64-key steps instead (:func:`choose_tiles`).
* 4 warps up to 8192 accumulator floats per program (16384 for short differential chunks),
  else 8; 3 pipeline stages for steps of up to 32 KiB, else 2 (shared memory).
* Decode tiles over a float8_e4m3fn cache read with a 16-bit query (:func:`fp8_decode_tiles`):
  twice the keys per step while the step stays within ``FP8_STEP_BYTES``, and
  ``FP8_DECODE_STAGES`` pipeline stages, so that the K/V loads of the next step overlap the
  dots of this one.
* Flash-decoding splits (:func:`choose_num_splits`) when the grid is too small to keep
  ``IN_FLIGHT_BYTES`` of K/V requested per multiprocessor, or to give every multiprocessor
  a program at all (small batches; split-count sweep of 2026-11-30 in
  ``profiling/results/triton_kernels.md``).
"""

from dataclasses import dataclass, replace

import torch
import triton

from .launch_utils import next_power_of_2

MIN_BLOCK_M = 16  # smallest M (and N, K) of tl.dot
MAX_BLOCK_M = 128
ACCUMULATOR_BUDGET = 32768  # float32 accumulator elements per program (128 a thread at 8 warps)
KV_STEP_BYTES = 65536  # K/V bytes loaded per key step, at most
IN_FLIGHT_BYTES = 262144  # K/V bytes per SM the split heuristic keeps requested
MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 256  # splits that only add requests in flight
MIN_KEYS_PER_FILL_SPLIT = 64  # splits that give idle multiprocessors a program
SHORT_CHUNK_TOKENS = 64  # differential launches (D <= 64) with at most this many tokens a sequence: 64-row tiles
FP8_STEP_BYTES = 32768  # K/V bytes per key step of an fp8-cache decode tile, at most
FP8_DECODE_REGISTERS = 168  # a thread's registers that keep 3 programs of 4 warps on a multiprocessor
FP8_DECODE_STAGES = 5  # K/V buffers in Triton 3.6: 1 at 2-4 stages, 2 at 5-6, 3 at 7 (fp8_decode_tiles)


@dataclass(frozen=True)
class TileConfig:
    """``block_m`` query rows (``block_m // group_pad`` tokens x ``group_pad`` heads, or half
    that many tokens when ``stacked``) against ``tile_n`` keys per step; ``num_warps``,
    ``num_stages`` and ``max_registers`` (a thread's, Triton's ``maxnreg``; ``None``:
    ptxas's choice) as Triton's launch options; ``programs_per_sm``: resident programs that
    keep ``IN_FLIGHT_BYTES`` requested."""

    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    stacked: bool = False
    max_registers: int | None = None

    def options(self) -> dict:
        """Triton's launch options."""
        registers = {} if self.max_registers is None else {"maxnreg": self.max_registers}
        return dict(num_warps=self.num_warps, num_stages=self.num_stages, **registers)

    def block_q(self, group_pad: int) -> int:
        """Query tokens per tile."""
        return self.block_m // group_pad // (2 if self.stacked else 1)


def choose_tiles(num_tokens: int, num_seqs: int, group_pad: int, head_size_pad: int,
                 differential: bool, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> TileConfig:
    """Tiles for a batch of ``num_tokens`` queries in ``num_seqs`` sequences, ``group_pad``
    query heads (pairs) per KV head (pair), head size padded to ``head_size_pad``; ``dtype``
    the query's, ``kv_dtype`` the cache's (``None``: the query's)."""
    tokens_per_seq = triton.cdiv(num_tokens, max(num_seqs, 1))
    rows_per_seq = tokens_per_seq * group_pad
    stacked = differential and 2 * next_power_of_2(rows_per_seq) <= MIN_BLOCK_M
    # float32 accumulator columns per row, in head sizes: [v1 | v2] once (stacked) or twice
    state = (2 if stacked else 4) if differential else 1
    operand = 4 if dtype == torch.float32 else 1  # float32 operands: more registers and smem
    max_block_m = ACCUMULATOR_BUDGET // (head_size_pad * state * operand)
    max_block_m = max(MIN_BLOCK_M, min(MAX_BLOCK_M, max_block_m))
    # Short differential chunks (head size up to 64): 64-row tiles of pipelined 64-key steps
    # at 4 warps. H200, Hq 32, Hkv 8, 2026-12-01 (`profiling/tile_sweep.py --chunk-tiles`,
    # attention and merge, splits by choose_num_splits), D 64: 60 tokens after 1024 cached
    # keys 26.5 -> 21.7 us, 60 tokens alone 25.6 -> 16.0, 124 tokens after 1024 with two
    # decode rows 49.2 -> 32.9, 186 after 1024 with six 72.2 -> 46.2 (128-row tiles of
    # unpipelined 128-key steps before). At D 128 the 64-key steps lost (124 after 1024:
    # 56.9 us against 40.9 for 64x128 w8 s1): wider heads keep the prefill tiles.
    short = differential and tokens_per_seq <= SHORT_CHUNK_TOKENS and head_size_pad <= 64
    if short:
        max_block_m = min(max_block_m, 64)
    block_m = max(MIN_BLOCK_M, group_pad, min(next_power_of_2(rows_per_seq), max_block_m))
    kv_loads = 4 if differential else 2  # k, v tiles (k1, k2 and the [v1 | v2] pair)
    token_bytes = head_size_pad * dtype.itemsize * kv_loads
    # Differential prefill tiles: twice the keys per step, unpipelined (sweep 2: 1.65 ms
    # against 1.88 ms for 64-key steps at 2 stages, B 8 x S 2048, D 128).
    wide_steps = differential and block_m >= 64 and not short
    step_limit = 2 * KV_STEP_BYTES if wide_steps else KV_STEP_BYTES
    tile_n = max(16, min(128 if wide_steps else 64, step_limit // token_bytes))
    step_bytes = tile_n * token_bytes
    accumulators = block_m * head_size_pad * state * operand
    tiles = TileConfig(block_m, tile_n, num_warps=4 if accumulators <= (16384 if short else 8192) else 8,
                       num_stages=1 if wide_steps else (3 if step_bytes <= 32768 else 2),
                       programs_per_sm=triton.cdiv(IN_FLIGHT_BYTES, step_bytes), stacked=stacked)
    if kv_dtype == torch.float8_e4m3fn and dtype.itemsize == 2 and block_m == MIN_BLOCK_M:
        return fp8_decode_tiles(tiles, head_size_pad * kv_loads, group_pad, head_size_pad)
    return tiles


def fp8_decode_tiles(tiles: TileConfig, token_bytes: int, group_pad: int, head_size_pad: int) -> TileConfig:
    """Decode tiles (``block_m`` 16) over a float8_e4m3fn cache, from those of a 16-bit
    cache (``tiles``); ``token_bytes``: the cache bytes of one key (K and V tiles);
    ``group_pad`` query heads per KV head, head size padded to ``head_size_pad``.

    Triton 3.6 for sm90 (PTX of the B=64 ctx 8k decode, Hq 32, Hkv 8, D 128; registers
    from ptxas): the 16-bit tiles' 3 stages give K and V one shared-memory buffer each (the
    block-table load takes a stage of its own), so a program issues the copy of key step
    ``i + 1`` only after the dots of step ``i`` and then waits for it; with fp8 tiles of 64
    keys that is 16 KiB requested per program, and 188 registers a thread leave 2 programs
    a multiprocessor (the bfloat16 kernel: 3 programs of 32 KiB). Here: twice the keys while
    the step stays within ``FP8_STEP_BYTES`` (the 16-bit step's bytes; the per-key costs of
    a step shrink: 45.6 against 52 SASS instructions a key), and ``FP8_DECODE_STAGES`` = 5
    stages, which give K and V two buffers each, so step ``i + 1`` is in flight during
    step ``i``'s dots (plain D 128: 128 keys, 168 registers, 73 KiB of shared memory, 3
    programs a multiprocessor). ``programs_per_sm`` is kept, so the split count, and with
    it the compiled variants that the engine's warm-up enumerates from the query's dtype,
    are those of the 16-bit cache.

    Plain tiles of ``group_pad >= 4`` and ``head_size_pad <= 128`` are held to
    ``FP8_DECODE_REGISTERS`` (Triton's ``maxnreg``): with the split strides specialized
    (``attention.split_strides``) ptxas gives the plain D 128 kernel 182 registers, 2
    programs a multiprocessor (H200, B=64 ctx 8k: 2.91 TB/s against 3.06 at 168). ptxas, 2026-12-01:
    no spill at 168 for group 4 and 16 at D 128, D 64 and D 96; spills for group 1 and 2
    and D 256 (their uncapped counts, 200-233, keep 2 programs either way)."""
    doubled = 2 * tiles.tile_n
    tile_n = doubled if doubled * token_bytes <= FP8_STEP_BYTES else tiles.tile_n
    capped = not tiles.stacked and group_pad >= 4 and head_size_pad <= 128
    return replace(tiles, tile_n=tile_n, num_stages=FP8_DECODE_STAGES,
                   max_registers=FP8_DECODE_REGISTERS if capped else None)


def choose_num_splits(num_seqs: int, num_tokens: int, block_q: int, num_kv_units: int,
                      max_kv_len: int, programs_per_sm: int, num_sms: int) -> int:
    """Flash-decoding splits of each query tile's key range.

    ``max_kv_len`` bounds the keys of any sequence (block-table width x block size, or the
    total key count). Two reasons to split, the larger count wins:

    * *fill*: fewer programs than multiprocessors (a batch of one or two sequences): split
      until every multiprocessor has one, down to ``MIN_KEYS_PER_FILL_SPLIT`` keys a split;
    * *in flight*: split while a whole ``programs_per_sm`` more programs per multiprocessor
      fit (rounded down: a partial wave of splits costs more in merging than it gains),
      down to ``MIN_KEYS_PER_SPLIT`` keys a split.

    Sweep on an H200 (Hq 32, Hkv 8, D 128): the best counts were 16 for B=1 at 1k keys,
    32-64 at 4k, 64 at 16k, 4 for B=16 at 1k and 1-2 for B=64 at 1k; this rule picks
    16, 17 (plain) / 33 (differential), 64, 4 and 2.

    A batch with more tokens than sequences (prefill chunks, mixed steps) splits only to
    fill: a query tile of several tokens writes as many partial rows a split, and its
    sequences may hold far fewer keys than ``max_kv_len`` (a graph captured for a 16k
    ``max_model_len``). ``profiling/tile_sweep.py --chunk-splits`` (H200, differential,
    Hq 32, Hkv 8, D 64, 2026-11-30; best count and time against the in-flight rule's): 60
    tokens after a 1024-key prefix 16 (24 us) against 64 (44 us; fill picks 17); 124
    tokens after 1024 keys and two decode rows 8 (37 us) against 33 (89 us; fill: 9); a
    chunk of 512 after 4096 keys 2 (185 us) against 8 (248 us; fill: 3); 1100 tokens
    with 4 decode rows 1 (147 us) against 2 (fill: 1).
    """
    busy = max(num_seqs, triton.cdiv(num_tokens, block_q)) * num_kv_units
    fill = min(triton.cdiv(num_sms, max(busy, 1)), triton.cdiv(max_kv_len, MIN_KEYS_PER_FILL_SPLIT))
    if num_tokens > num_seqs:
        return max(1, min(fill, MAX_SPLITS))
    in_flight = min(programs_per_sm * num_sms // max(busy, 1), triton.cdiv(max_kv_len, MIN_KEYS_PER_SPLIT))
    return max(1, min(max(fill, in_flight), MAX_SPLITS))
