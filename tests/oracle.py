"""An independent, naive float64 oracle for the attention ops.

Written from the op contract (flash-attn 2.x conventions), deliberately NOT from
``compiled_attn.ops.reference``: it must never import that module. Everything runs in
float64, one sequence and one head at a time, with the visibility mask built cell by cell
in plain Python:

* query ``i`` of a sequence with ``q_len`` queries and ``k_len`` keys sits at key
  position ``p = i + k_len - q_len`` (bottom-right alignment);
* ``causal`` keeps keys ``j <= p``;
* ``window = (left, right)`` keeps keys ``p - left <= j <= p + right``; ``-1`` is unbounded;
* ``softcap > 0`` maps the *scaled* score ``s`` to ``softcap * tanh(s / softcap)``;
* ALiBi adds ``-slope[h] * |p - j|`` after the softcap;
* a query row that sees no key is all zeros;
* GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``.

Differential attention (Ye et al. 2024) over interleaved head pairs: query heads ``2j`` and
``2j + 1`` are components 1 and 2 of query pair ``j``, KV heads ``2m``/``2m + 1`` components
1/2 of KV pair ``m``; query pair ``j`` reads KV pair ``j // (Hq // Hkv)``; the output of
pair ``j`` is ``attn(q1, k1, [v1, v2]) - lambda_j * attn(q2, k2, [v1, v2])``,
``[q_len, Hq // 2, 2 * D]``. ALiBi slopes are indexed by query head (component 1 of pair
``j`` uses ``slopes[2j]``, component 2 ``slopes[2j + 1]``).

Inputs may live on any device; the oracle copies them to the CPU and returns CPU float64.

The helpers at the bottom (:func:`assert_close_to_oracle`, :func:`tolerances`) hold the
comparison used by every op test, so that kernel tests (Triton, CUDA) share it.
"""

from __future__ import annotations

import torch

__all__ = [
    "assert_close_to_oracle",
    "gather_paged",
    "oracle_attention",
    "oracle_differential",
    "oracle_paged",
    "oracle_varlen",
    "visibility_mask",
]


def visibility_mask(q_len: int, k_len: int, causal: bool, window: tuple[int, int]) -> list[list[bool]]:
    """``mask[i][j]`` is True when query ``i`` may attend to key ``j`` (plain Python)."""
    left, right = window
    mask = []
    for i in range(q_len):
        p = i + k_len - q_len
        row = []
        for j in range(k_len):
            ok = True
            if causal and j > p:
                ok = False
            if left >= 0 and j < p - left:
                ok = False
            if right >= 0 and j > p + right:
                ok = False
            row.append(ok)
        mask.append(row)
    return mask


def _one_head(q, k, v, scale, mask, distance, softcap, slope):
    """One head of one sequence, float64. q ``[q_len, D]``, k ``[k_len, D]``,
    v ``[k_len, Dv]``; ``mask`` bool and ``distance`` (``|p - j|``) ``[q_len, k_len]``.
    Returns ``[q_len, Dv]``; rows with no visible key are zeros."""
    scores = (q @ k.transpose(0, 1)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if slope is not None:
        scores = scores - slope * distance
    out = torch.zeros(q.shape[0], v.shape[1], dtype=torch.float64)
    for i in range(q.shape[0]):
        row_mask = mask[i]
        if not bool(row_mask.any()):
            continue  # no visible key -> zeros
        s = scores[i][row_mask]
        w = torch.exp(s - s.max())
        out[i] = (w / w.sum()) @ v[row_mask]
    return out


def _mask_and_distance(q_len, k_len, causal, window):
    mask = torch.tensor(visibility_mask(q_len, k_len, causal, tuple(window)), dtype=torch.bool)
    mask = mask.reshape(q_len, k_len)
    distance = torch.tensor(
        [[abs(i + k_len - q_len - j) for j in range(k_len)] for i in range(q_len)],
        dtype=torch.float64,
    ).reshape(q_len, k_len)
    return mask, distance


def oracle_attention(q, k, v, scale, causal=True, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Plain attention of ONE sequence, float64.

    Args:
        q: ``[q_len, Hq, D]``; k: ``[k_len, Hkv, D]``; v: ``[k_len, Hkv, Dv]``.
        scale: softmax scale (applied before softcap).
        causal, window, softcap: see the module docstring.
        alibi_slopes: ``[Hq]`` or None.

    Returns:
        ``[q_len, Hq, Dv]`` float64.
    """
    q, k, v = (t.detach().cpu().double() for t in (q, k, v))
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    assert num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    mask, distance = _mask_and_distance(q_len, k_len, causal, window)
    slopes = None if alibi_slopes is None else [float(s) for s in alibi_slopes.detach().cpu().double()]
    out = torch.zeros(q_len, num_heads, v.shape[2], dtype=torch.float64)
    for h in range(num_heads):
        kvh = h // group
        slope = None if slopes is None else slopes[h]
        out[:, h] = _one_head(q[:, h], k[:, kvh], v[:, kvh], scale, mask, distance, softcap, slope)
    return out


def oracle_differential(q, k, v, lambda_full, scale, causal=True, window=(-1, -1), softcap=0.0,
                        alibi_slopes=None):
    """Differential attention of ONE sequence over interleaved head pairs, float64.

    Args:
        q: ``[q_len, Hq, D]`` (Hq even); k, v: ``[k_len, Hkv, D]`` (Hkv even).
        lambda_full: number, 0-d tensor, or ``[Hq // 2]`` tensor.

    Returns:
        ``[q_len, Hq // 2, 2 * D]`` float64.
    """
    q, k, v = (t.detach().cpu().double() for t in (q, k, v))
    q_len, num_heads, head_size = q.shape
    k_len, num_kv_heads, _ = k.shape
    assert num_heads % 2 == 0 and num_kv_heads % 2 == 0
    num_pairs, num_kv_pairs = num_heads // 2, num_kv_heads // 2
    group = num_pairs // num_kv_pairs
    lam = torch.as_tensor(lambda_full).detach().cpu().double().reshape(-1)
    lambdas = [float(lam[0])] * num_pairs if lam.numel() == 1 else [float(x) for x in lam]
    assert len(lambdas) == num_pairs
    mask, distance = _mask_and_distance(q_len, k_len, causal, window)
    slopes = None if alibi_slopes is None else [float(s) for s in alibi_slopes.detach().cpu().double()]
    out = torch.zeros(q_len, num_pairs, 2 * head_size, dtype=torch.float64)
    for j in range(num_pairs):
        m = j // group
        k1, k2 = k[:, 2 * m], k[:, 2 * m + 1]
        v_cat = torch.cat([v[:, 2 * m], v[:, 2 * m + 1]], dim=-1)
        s1 = None if slopes is None else slopes[2 * j]
        s2 = None if slopes is None else slopes[2 * j + 1]
        a1 = _one_head(q[:, 2 * j], k1, v_cat, scale, mask, distance, softcap, s1)
        a2 = _one_head(q[:, 2 * j + 1], k2, v_cat, scale, mask, distance, softcap, s2)
        out[:, j] = a1 - lambdas[j] * a2
    return out


def gather_paged(cache: torch.Tensor, block_row, seq_len: int) -> torch.Tensor:
    """Keys (or values) ``0 .. seq_len-1`` of one sequence, token by token from the cache:
    position ``t`` lives in block ``block_row[t // block_size]`` at offset ``t % block_size``."""
    block_size = cache.shape[1]
    rows = []
    for t in range(seq_len):
        block = int(block_row[t // block_size])
        rows.append(cache[block, t % block_size])
    if not rows:
        return cache.new_zeros((0, *cache.shape[2:]))
    return torch.stack(rows)


def _attend(q, k, v, lambda_full, scale, causal, window, softcap, alibi_slopes):
    if lambda_full is None:
        return oracle_attention(q, k, v, scale, causal, window, softcap, alibi_slopes)
    return oracle_differential(q, k, v, lambda_full, scale, causal, window, softcap, alibi_slopes)


def _out_shape(num_tokens, num_heads, head_size, differential):
    if differential:
        return (num_tokens, num_heads // 2, 2 * head_size)
    return (num_tokens, num_heads, head_size)


def oracle_paged(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, scale=None,
                 causal=True, window=(-1, -1), softcap=0.0, alibi_slopes=None, lambda_full=None):
    """Batch of queries against a paged KV cache, float64, sequence by sequence.

    Shapes as ``compiled_attn.ops.paged_attention``; ``lambda_full`` given -> differential.
    """
    query, key_cache, value_cache, block_table = (
        t.detach().cpu() for t in (query, key_cache, value_cache, block_table))
    num_tokens, num_heads, head_size = query.shape
    scale = head_size ** -0.5 if scale is None else scale
    out = torch.zeros(_out_shape(num_tokens, num_heads, head_size, lambda_full is not None),
                      dtype=torch.float64)
    cu = [int(x) for x in cu_seqlens_q]
    for b, seq_len in enumerate(int(x) for x in seq_lens):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        k = gather_paged(key_cache, block_table[b], seq_len)
        v = gather_paged(value_cache, block_table[b], seq_len)
        out[start:end] = _attend(query[start:end], k, v, lambda_full, scale, causal, window,
                                 softcap, alibi_slopes)
    return out


def oracle_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, causal=True, window=(-1, -1),
                  softcap=0.0, alibi_slopes=None, lambda_full=None):
    """Packed varlen attention over contiguous k/v, float64, sequence by sequence."""
    q, k, v = (t.detach().cpu() for t in (q, k, v))
    num_tokens, num_heads, head_size = q.shape
    scale = head_size ** -0.5 if scale is None else scale
    out = torch.zeros(_out_shape(num_tokens, num_heads, head_size, lambda_full is not None),
                      dtype=torch.float64)
    cq = [int(x) for x in cu_seqlens_q]
    ck = [int(x) for x in cu_seqlens_k]
    for b in range(len(cq) - 1):
        if cq[b + 1] == cq[b]:
            continue
        ks, ke = ck[b], ck[b + 1]
        out[cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], k[ks:ke], v[ks:ke], lambda_full, scale,
                                       causal, window, softcap, alibi_slopes)
    return out


# --- comparison -------------------------------------------------------------------------

#: dtype -> (max relative L2 error of the whole output, max abs error per element relative
#: to max(1, max |oracle|)). fp32 is tight; fp16/bf16 allow for rounding of the output and
#: of a kernel's low-precision P @ V.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (1e-2, 4e-2),
}


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES[dtype]


def assert_close_to_oracle(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                           what: str = "output") -> None:
    """Every element finite, shapes equal, error within :data:`TOLERANCES` of ``dtype``
    (default ``out.dtype``): relative L2 over the whole tensor and max abs error per element."""
    dtype = out.dtype if dtype is None else dtype
    assert out.dtype == dtype, f"{what}: dtype {out.dtype}, expected {dtype}"
    assert tuple(out.shape) == tuple(expected.shape), f"{what}: shape {tuple(out.shape)} vs {tuple(expected.shape)}"
    assert bool(torch.isfinite(out).all()), f"{what}: non-finite values at {torch.nonzero(~torch.isfinite(out))[:8].tolist()}"
    got = out.detach().cpu().double()
    ref = expected.detach().cpu().double()
    rel_tol, abs_tol = tolerances(dtype)
    if got.numel() == 0:
        return
    diff = (got - ref).abs()
    ref_norm = ref.norm().item()
    # an all-zero oracle (e.g. only padded rows): the absolute error must then be ~0 too
    rel_l2 = (got - ref).norm().item() / ref_norm if ref_norm > 0 else diff.max().item()
    max_err = diff.max().item()
    bound = abs_tol * max(1.0, ref.abs().max().item())
    assert rel_l2 < rel_tol, f"{what}: relative L2 error {rel_l2:.3g} >= {rel_tol:g} ({dtype})"
    if max_err > bound:
        where = tuple(torch.nonzero(diff == diff.max())[0].tolist())
        raise AssertionError(
            f"{what}: max abs error {max_err:.3g} > {bound:.3g} ({dtype}) at {where}: "
            f"got {got[where].item():.6g}, expected {ref[where].item():.6g}"
        )
