"""Random test batches for the attention and cache ops (CPU, small shapes).

Shared by the reference-op tests and the Triton-interpreter kernel tests, so the API is
plain: describe each sequence, get a dataclass of tensors.

    batch = make_paged_batch([(0, 20), (37, 5), (50, 1), pad(1)], block_size=16,
                             num_heads=4, num_kv_heads=2, head_size=32,
                             dtype=torch.float16, seed=0)
    out = paged_attention(batch.query, batch.key_cache, batch.value_cache,
                          batch.cu_seqlens_q, batch.seq_lens, batch.block_table)

A sequence is ``(context_len, query_len)``: ``context_len`` keys already cached plus
``query_len`` new tokens, so ``seq_len = context_len + query_len``:

* prefill ``(0, n)``; chunked prefill / prefix hit ``(c, n)``; decode ``(c, 1)``;
  multi-token decode ``(c, 2..4)``; a sequence with no query this step ``(c, 0)``;
* ``pad(q)``: a padded row (as in a captured CUDA graph): ``seq_len`` 0, ``q`` queries
  whose output must be exactly zero, slot ``PAD_SLOT_ID`` (-1) for its tokens.

The caches are fully filled with random non-zero values (slots no sequence owns too: a
kernel that reads past ``seq_len`` gets garbage and fails the comparison; pass
``unused_fill="nan"`` to make that garbage NaN). Blocks are handed out in a random
permutation, so block ids are not contiguous, and ``block_table`` has ``extra_columns``
padding columns holding random *valid* block ids of other sequences.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace

import torch

PAD_SLOT_ID = -1

__all__ = [
    "PAD_SLOT_ID", "Pad", "PagedBatch", "VarlenBatch", "alibi_slopes", "make_lambda",
    "kernel_device", "make_paged_batch", "make_varlen_batch", "pad", "randn_nonzero",
]


def kernel_device() -> str:
    """The device a module's Triton kernel tests run on: ``"cuda"``, or ``"cpu"`` under
    Triton's interpreter (``TRITON_INTERPRET=1``, Triton 3.9 or later: older interpreters
    cannot use loaded scalars as loop bounds under NumPy 2, see ``test_triton_interpret.py``).
    Otherwise skips the calling module (call it at import time)."""
    import pytest
    import triton

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot use loaded scalars as loop bounds under "
                    "NumPy 2 (see test_triton_interpret.py)", allow_module_level=True)
    return "cpu"


def _to(obj, device):
    """A copy of a batch dataclass with every tensor (also in lists) moved to ``device``."""
    changes = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = value.to(device)
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            changes[f.name] = [t.to(device) for t in value]
    return replace(obj, **changes)


@dataclass(frozen=True)
class Pad:
    """A padded batch row: ``seq_len`` 0, ``query_len`` queries, slots -1."""

    query_len: int = 1


def pad(query_len: int = 1) -> Pad:
    return Pad(query_len)


def randn_nonzero(shape, dtype: torch.dtype, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Standard normal values (times ``scale``) in ``dtype`` with no exact zero."""
    x = (torch.randn(shape, generator=generator, dtype=torch.float32) * scale).to(dtype)
    return torch.where(x == 0, torch.ones((), dtype=dtype), x)


@dataclass
class PagedBatch:
    """One batch of paged attention, every tensor on the CPU.

    Attributes:
        query: ``[T, Hq, D]`` new tokens' queries, sequences packed back to back.
        key, value: ``[T, Hkv, D]`` new tokens' keys/values (what ``reshape_and_cache``
            writes); rows of padded sequences are random and have slot -1.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``, context AND new
            tokens already written (ready for attention).
        slot_mapping: ``[T]`` int64 slot of each new token, -1 for padded rows.
        cu_seqlens_q: ``[B + 1]`` int32.
        seq_lens: ``[B]`` int32, ``context_len + query_len`` (0 for padded rows).
        block_table: ``[B, max_blocks + extra_columns]`` int32.
        context_lens, query_lens: per sequence (Python ints).
        padded: per sequence, True for a padded row.
        keys, values: per sequence, the contiguous ``[seq_len, Hkv, D]`` keys/values that
            the cache holds for it (ground truth for an oracle or a varlen call).
        pad_rows: token indices of padded rows (their outputs must be exact zeros).
        used_slots: every slot (``block * block_size + offset``) that holds a key of a
            sequence; all other slots are garbage.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    context_lens: list[int]
    query_lens: list[int]
    padded: list[bool]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    pad_rows: list[int]
    used_slots: list[int]
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[0]

    def to(self, device) -> "PagedBatch":
        """The same batch with every tensor on ``device`` (e.g. for GPU kernel tests)."""
        return _to(self, device)

    def attention_args(self) -> tuple[torch.Tensor, ...]:
        """``(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table)``."""
        return (self.query, self.key_cache, self.value_cache, self.cu_seqlens_q, self.seq_lens,
                self.block_table)

    def caches_before_write(self, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the caches whose new-token slots hold other random values, i.e. the
        state before ``reshape_and_cache(key, value, ..., slot_mapping)``."""
        g = torch.Generator().manual_seed(seed)
        kc, vc = self.key_cache.clone(), self.value_cache.clone()
        slots = self.slot_mapping[self.slot_mapping >= 0]
        for cache in (kc, vc):
            flat = cache.view(-1, *cache.shape[2:])
            flat[slots] = randn_nonzero(flat[slots].shape, cache.dtype, g)
        return kc, vc

    def to_varlen(self) -> "VarlenBatch":
        """The same attention with contiguous k/v (``cu_seqlens_k`` = cumsum of seq_lens)."""
        q_lens = list(self.query_lens)
        k_lens = [k.shape[0] for k in self.keys]
        empty = self.key_cache.new_zeros((0, self.num_kv_heads, self.head_size))
        k = torch.cat([empty, *self.keys])
        v = torch.cat([empty, *self.values])
        return VarlenBatch(
            q=self.query, k=k, v=v, cu_seqlens_q=self.cu_seqlens_q.clone(),
            cu_seqlens_k=_cumsum(k_lens), q_lens=q_lens, k_lens=k_lens,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_size,
            dtype=self.dtype,
        )


@dataclass
class VarlenBatch:
    """One batch of varlen attention over contiguous k/v (CPU).

    Attributes:
        q: ``[total_q, Hq, D]``; k, v: ``[total_k, Hkv, D]``.
        cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` int32.
        q_lens, k_lens: per sequence.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    q_lens: list[int]
    k_lens: list[int]
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    empty_rows: list[int] = field(default_factory=list)

    def to(self, device) -> "VarlenBatch":
        """The same batch with every tensor on ``device``."""
        return _to(self, device)

    def attention_args(self) -> tuple[torch.Tensor, ...]:
        """``(q, k, v, cu_seqlens_q, cu_seqlens_k)``."""
        return (self.q, self.k, self.v, self.cu_seqlens_q, self.cu_seqlens_k)


def _cumsum(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def make_paged_batch(
    seqs,
    block_size: int = 16,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    extra_columns: int = 2,
    spare_blocks: int = 3,
    unused_fill: str = "random",
    value_scale: float = 1.0,
) -> PagedBatch:
    """Build a random paged-attention batch.

    Args:
        seqs: per sequence ``(context_len, query_len)`` or :func:`pad` ``(query_len)``.
        block_size, num_heads, num_kv_heads, head_size, dtype: shapes of the batch.
        seed: everything random comes from ``torch.Generator().manual_seed(seed)``.
        extra_columns: block_table columns beyond the longest sequence's need.
        spare_blocks: cache blocks that belong to no sequence (garbage).
        unused_fill: ``"random"`` (non-zero random garbage) or ``"nan"`` for every cache
            slot that holds no key of any sequence.
        value_scale: scale of the random queries/keys/values (bigger -> peakier softmax).
    """
    g = torch.Generator().manual_seed(seed)
    specs = []
    for s in seqs:
        if isinstance(s, Pad):
            specs.append((0, s.query_len, True))
        else:
            ctx, ql = s
            specs.append((int(ctx), int(ql), False))
    seq_lens = [0 if p else c + q for c, q, p in specs]
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    width = max([0, *blocks_needed]) + extra_columns
    perm = torch.randperm(num_blocks, generator=g).tolist()

    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = randn_nonzero(shape, dtype, g, value_scale)
    value_cache = randn_nonzero(shape, dtype, g, value_scale)

    block_table = torch.empty((len(specs), width), dtype=torch.int32)
    keys, values, used_slots = [], [], []
    slot_mapping, queries, new_k, new_v, pad_rows = [], [], [], [], []
    next_block, token = 0, 0
    for b, ((ctx, ql, is_pad), seq_len, nb) in enumerate(zip(specs, seq_lens, blocks_needed)):
        own = perm[next_block:next_block + nb]
        next_block += nb
        others = [x for x in perm if x not in own] or perm
        filler = [others[int(i)] for i in torch.randint(len(others), (width - nb,), generator=g)]
        block_table[b] = torch.tensor(own + filler, dtype=torch.int32)
        slots = [own[t // block_size] * block_size + t % block_size for t in range(seq_len)]
        used_slots.extend(slots)
        flat_k = key_cache.view(-1, num_kv_heads, head_size)
        flat_v = value_cache.view(-1, num_kv_heads, head_size)
        idx = torch.tensor(slots, dtype=torch.long)
        keys.append(flat_k[idx].clone())
        values.append(flat_v[idx].clone())
        queries.append(randn_nonzero((ql, num_heads, head_size), dtype, g, value_scale))
        if is_pad:
            new_k.append(randn_nonzero((ql, num_kv_heads, head_size), dtype, g, value_scale))
            new_v.append(randn_nonzero((ql, num_kv_heads, head_size), dtype, g, value_scale))
            slot_mapping.extend([PAD_SLOT_ID] * ql)
            pad_rows.extend(range(token, token + ql))
        else:
            new_k.append(keys[-1][ctx:].clone())
            new_v.append(values[-1][ctx:].clone())
            slot_mapping.extend(slots[ctx:])
        token += ql

    if unused_fill == "nan":
        unused = torch.ones(num_blocks * block_size, dtype=torch.bool)
        unused[torch.tensor(used_slots, dtype=torch.long)] = False
        key_cache.view(-1, num_kv_heads, head_size)[unused] = float("nan")
        value_cache.view(-1, num_kv_heads, head_size)[unused] = float("nan")
    elif unused_fill != "random":
        raise ValueError(f"unused_fill must be 'random' or 'nan', got {unused_fill!r}")

    empty_q = torch.zeros((0, num_heads, head_size), dtype=dtype)
    empty_kv = torch.zeros((0, num_kv_heads, head_size), dtype=dtype)
    return PagedBatch(
        query=torch.cat([empty_q, *queries]),
        key=torch.cat([empty_kv, *new_k]),
        value=torch.cat([empty_kv, *new_v]),
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        cu_seqlens_q=_cumsum([q for _, q, _ in specs]),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        context_lens=[c for c, _, _ in specs],
        query_lens=[q for _, q, _ in specs],
        padded=[p for _, _, p in specs],
        keys=keys,
        values=values,
        pad_rows=pad_rows,
        used_slots=used_slots,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
    )


def make_varlen_batch(
    q_lens: list[int],
    k_lens: list[int] | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    value_scale: float = 1.0,
) -> VarlenBatch:
    """Build a random varlen batch; ``k_lens`` defaults to ``q_lens`` (self-attention).

    ``q_lens[b] != k_lens[b]`` gives cross-attention (or, causal, bottom-right aligned
    queries); ``k_lens[b] == 0`` with ``q_lens[b] > 0`` gives rows that see no key
    (listed in ``empty_rows``; their output must be zeros).
    """
    k_lens = list(q_lens) if k_lens is None else list(k_lens)
    assert len(k_lens) == len(q_lens)
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(q_lens), sum(k_lens)
    q = randn_nonzero((total_q, num_heads, head_size), dtype, g, value_scale)
    k = randn_nonzero((total_k, num_kv_heads, head_size), dtype, g, value_scale)
    v = randn_nonzero((total_k, num_kv_heads, head_size), dtype, g, value_scale)
    empty_rows, start = [], 0
    for ql, kl in zip(q_lens, k_lens):
        if kl == 0:
            empty_rows.extend(range(start, start + ql))
        start += ql
    return VarlenBatch(
        q=q, k=k, v=v, cu_seqlens_q=_cumsum(list(q_lens)), cu_seqlens_k=_cumsum(k_lens),
        q_lens=list(q_lens), k_lens=k_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, dtype=dtype, empty_rows=empty_rows,
    )


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The standard ALiBi slopes (Press et al.), ``[num_heads]`` float32 (power-of-two
    interpolation as in the ALiBi paper's code)."""
    def pow2(n):
        start = 2 ** (-(2 ** -(torch.log2(torch.tensor(float(n))).item() - 3)))
        return [start * start ** i for i in range(n)]

    closest = 2 ** int(torch.log2(torch.tensor(float(num_heads))).floor().item())
    slopes = pow2(closest)
    if closest < num_heads:
        slopes += pow2(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def make_lambda(num_heads: int, per_pair: bool, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A differential ``lambda_full``: 0-d tensor (``per_pair=False``) or ``[num_heads // 2]``
    with distinct values in [0.2, 0.9]."""
    g = torch.Generator().manual_seed(seed + 77)
    if per_pair:
        return (0.2 + 0.7 * torch.rand(num_heads // 2, generator=g)).to(dtype)
    return torch.tensor(0.2 + 0.7 * torch.rand((), generator=g).item(), dtype=dtype)
