"""Merge of split-KV (flash-decoding) partial results.

Split ``s`` of a query row left a normalized partial output ``o_s`` and its base-2
log-sum-exp ``lse_s`` over its share of the keys; the full row is
``sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with ``M = max_s lse_s`` (Dao et al.,
"Flash-Decoding for long-context inference", 2023; the same rescaling as the online
softmax). Splits that saw no key have ``lse_s = -inf`` and weigh nothing; a row no split
saw is zeros. Only partials of splits with a finite ``lse_s`` are read: a split that saw no
key tile writes none (the attention kernel), so a launch whose key bound (``max_kv_len``,
e.g. a 16k ``max_model_len``) far exceeds its sequences moves no memory for its idle
splits. Differential rows merge the two components (query heads ``2j`` and ``2j + 1``)
separately, then combine ``o1 - lambda_j * o2`` in float32. A row of
``VALUE_SIZE`` (``D`` or ``2D``, any ``D`` from 1 to 256) is read and written as
``VALUE_SIZE_PAD`` (the next power of two) masked columns, ``BLOCK_V`` of them per program
(:func:`merge_block_v`): a batch of one sequence has few rows, and a program that held all
``SPLITS_PAD x VALUE_SIZE_PAD`` partials of a row ran alone on its multiprocessor (28 us per
merge at 33 splits of a 2k context on the H200, 5x the attention kernel before it).
"""

import triton
import triton.language as tl


MERGE_TILE = 2048
"""Partials (splits x value columns) one merge program holds per query head."""


def merge_block_v(value_size_pad: int, splits_pad: int) -> int:
    """Value columns per merge program: all of them while ``splits_pad x value_size_pad``
    fits :data:`MERGE_TILE`, else fewer (at least 16), so long flash-decoding splits spread
    over more programs."""
    return min(value_size_pad, max(16, MERGE_TILE // splits_pad))


@triton.jit
def _merge_head(part_ptr, lse_ptr, token, head, num_splits, dims,
                stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                VALUE_SIZE: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Merged float32 output of one query head of one token at value columns ``dims``."""
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    lse = tl.load(lse_ptr + splits * stride_ls + token * stride_lt + head, mask=split_ok,
                  other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    seen = lse > float("-inf")  # a split whose lse is -inf may have left its partial unwritten
    part = tl.load(part_ptr + splits[:, None] * stride_ps + token * stride_pt + head * stride_ph
                   + dims[None, :], mask=seen[:, None] & (dims < VALUE_SIZE)[None, :], other=0.0)
    total = tl.sum(weight, 0)
    return tl.sum(weight[:, None] * part, 0) / tl.where(total > 0, total, 1.0)


# num_splits depends on the batch; the split strides do too, but are 16-divisible (split_strides)
@triton.jit(do_not_specialize=["num_splits"])
def merge_splits_kernel(
    out_ptr, part_ptr, lse_ptr, lambda_ptr, num_splits,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    VALUE_SIZE: tl.constexpr, BLOCK_V: tl.constexpr, SPLITS_PAD: tl.constexpr,
    DIFFERENTIAL: tl.constexpr, LAMBDA_PER_PAIR: tl.constexpr,
):
    """One program per (token, output head, ``BLOCK_V`` value columns); grid
    ``(T, Hq, cdiv(VALUE_SIZE, BLOCK_V))`` or, differential, ``(T, Hq/2, ...)``.

    Args:
        out_ptr: ``[T, Hq, D]`` or ``[T, Hq/2, 2D]``, the query's dtype (last dim contiguous).
        part_ptr: float32 ``[num_splits, T, Hq, VALUE_SIZE]`` (last dim contiguous).
        lse_ptr: float32 ``[num_splits, T, Hq]`` (head dim contiguous).
        lambda_ptr: ``[]`` or ``[Hq/2]`` differential lambda (differential only).
    """
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    if DIFFERENTIAL:
        o1 = _merge_head(part_ptr, lse_ptr, token, 2 * head, num_splits, dims, stride_ps, stride_pt,
                         stride_ph, stride_ls, stride_lt, VALUE_SIZE, SPLITS_PAD)
        o2 = _merge_head(part_ptr, lse_ptr, token, 2 * head + 1, num_splits, dims, stride_ps, stride_pt,
                         stride_ph, stride_ls, stride_lt, VALUE_SIZE, SPLITS_PAD)
        if LAMBDA_PER_PAIR:
            lam = tl.load(lambda_ptr + head).to(tl.float32)
        else:
            lam = tl.load(lambda_ptr).to(tl.float32)
        out = o1 - lam * o2
    else:
        out = _merge_head(part_ptr, lse_ptr, token, head, num_splits, dims, stride_ps, stride_pt,
                          stride_ph, stride_ls, stride_lt, VALUE_SIZE, SPLITS_PAD)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < VALUE_SIZE)
