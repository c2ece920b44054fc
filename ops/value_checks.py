"""Value checks of the ops' metadata: block ids, lengths, cumulative lengths, slots.

Reading metadata values means reading device memory, so each check copies what it needs
to the host in one transfer (one device-to-host synchronization for CUDA tensors, a view for
CPU tensors) and checks it there with vectorized NumPy. The public functions of
:mod:`compiled_attn.ops` run them before the op, eagerly only. They are skipped:

* while ``torch.compile`` traces, on fake or meta tensors (no values), or while a CUDA
  graph is being captured (:func:`should_check`);
* when the environment variable ``COMPILED_ATTN_CHECK_VALUES`` is ``0``, ``false``, ``off``
  or ``no`` (any case);
* for metadata already checked unchanged: each kind of check remembers the tensors of its
  last passing call (weak references) and their version counters, which every PyTorch
  in-place write bumps. The layers of one model forward share one batch's metadata, which
  is then checked once, not once per layer. Writes that bypass the version counter
  (CUDA-graph replays, ``tensor.data``, kernels writing through raw pointers) are not seen.

Every failure is a ``ValueError`` naming the argument, the offending entry and what is
allowed.
"""

from __future__ import annotations

import math
import os
import weakref

import numpy as np
import torch

from .arith import cdiv


def values_readable(tensor: torch.Tensor) -> bool:
    """Whether a tensor has values to read: not a FakeTensor or FunctionalTensor (tracing),
    not on the meta device."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return not isinstance(tensor, (FakeTensor, FunctionalTensor)) and tensor.device.type != "meta"


def _turned_off(setting: str) -> bool:
    return setting.strip().lower() in ("0", "false", "off", "no")


def should_check(tensor: torch.Tensor) -> bool:
    """True when value checks are wanted and affordable: eager on real tensors, not tracing,
    not capturing, and ``COMPILED_ATTN_CHECK_VALUES`` does not turn them off."""
    if torch.compiler.is_compiling() or _turned_off(os.environ.get("COMPILED_ATTN_CHECK_VALUES", "")):
        return False
    return values_readable(tensor) and not (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


class _LastPassed:
    """The arguments of one kind of check's last passing call: weak references to its
    tensors, their version counters and the sizes it was checked against."""

    def __init__(self) -> None:
        self.refs: tuple[weakref.ref, ...] = ()
        self.key: tuple = ()

    def same(self, tensors: tuple[torch.Tensor, ...], sizes: tuple[int, ...]) -> bool:
        if any(t.is_inference() for t in tensors):  # inference tensors have no version counter
            return False
        key = (*(t._version for t in tensors), *sizes)
        return (key == self.key and len(self.refs) == len(tensors)
                and all(ref() is t for ref, t in zip(self.refs, tensors)))

    def remember(self, tensors: tuple[torch.Tensor, ...], sizes: tuple[int, ...]) -> None:
        if not any(t.is_inference() for t in tensors):
            self.refs = tuple(weakref.ref(t) for t in tensors)
            self.key = (*(t._version for t in tensors), *sizes)


_PAGED, _VARLEN, _SLOTS = _LastPassed(), _LastPassed(), _LastPassed()


def _to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """``tensors`` (integer, one device) as flat NumPy arrays, in one transfer."""
    flat = [t.reshape(-1) for t in tensors]
    if tensors[0].device.type == "cpu":
        return [t.numpy() for t in flat]
    host = (torch.cat(flat) if len(flat) > 1 else flat[0]).cpu().numpy()
    return np.split(host, np.cumsum([t.numel() for t in flat])[:-1])


def _check_cu_seqlens(name: str, cu: np.ndarray, total: int, at_most: bool = False) -> np.ndarray:
    """Per-sequence lengths of a valid ``cu_seqlens`` (ending at ``total``, or at most there
    when ``at_most``); raises otherwise."""
    lengths = np.diff(cu)
    if cu[0] != 0 or (cu[-1] > total if at_most else cu[-1] != total) or (lengths < 0).any():
        raise ValueError(
            f"{name} must start at 0, never decrease and end at {'or below ' * at_most}the token count {total}, "
            f"got {cu[:16].tolist()}{' ...' if cu.size > 16 else ''}"
        )
    return lengths


def check_paged_values(query: torch.Tensor, key_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       seq_lens: torch.Tensor, block_table: torch.Tensor) -> None:
    """``cu_seqlens_q`` well formed; ``0 <= seq_lens[b] <= block_table width x block_size``;
    the block ids of each sequence's keys (its first ``ceil(seq_lens[b] / block_size)``
    columns) inside ``[0, num_blocks)``. Padding columns may hold anything.

    Raises:
        ValueError: the first violation, naming the argument and entry.
    """
    num_blocks, block_size = key_cache.shape[:2]
    tensors, sizes = (cu_seqlens_q, seq_lens, block_table), (query.shape[0], num_blocks, block_size)
    if _PAGED.same(tensors, sizes):
        return
    cu, lens, table = _to_host(*tensors)
    width = block_table.shape[1]
    _check_cu_seqlens("cu_seqlens_q", cu, query.shape[0])
    max_len = width * block_size
    bad = np.flatnonzero((lens < 0) | (lens > max_len))
    if bad.size:
        b = bad[0]
        raise ValueError(f"seq_lens[{b}]={lens[b]} is out of range [0, {max_len}] "
                         f"(block_table width {width} x block_size {block_size})")
    used = np.arange(width) < cdiv(lens, block_size)[:, None]
    table = table.reshape(lens.shape[0], width)
    bad_rows = np.flatnonzero((used & ((table < 0) | (table >= num_blocks))).any(axis=1))
    if bad_rows.size:
        b = bad_rows[0]
        ids = table[b][used[b] & ((table[b] < 0) | (table[b] >= num_blocks))]
        raise ValueError(f"block_table[{b}] holds block ids {ids[:8].tolist()} outside [0, {num_blocks})")
    _PAGED.remember(tensors, sizes)


def check_varlen_values(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, keys_past_end: bool = False) -> None:
    """Both ``cu_seqlens`` start at 0, never decrease and end at the token counts
    (``keys_past_end``: ``cu_seqlens_k`` at or below ``k``'s, rows past it never read, as
    the Gluon launcher allows).

    Raises:
        ValueError: naming the malformed ``cu_seqlens``.
    """
    tensors, sizes = (cu_seqlens_q, cu_seqlens_k), (q.shape[0], k.shape[0], keys_past_end)
    if _VARLEN.same(tensors, sizes):
        return
    cu_q, cu_k = _to_host(*tensors)
    _check_cu_seqlens("cu_seqlens_q", cu_q, q.shape[0])
    _check_cu_seqlens("cu_seqlens_k", cu_k, k.shape[0], at_most=keys_past_end)
    _VARLEN.remember(tensors, sizes)


def check_slot_values(key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Every slot is ``PAD_SLOT_ID`` (-1) or inside ``[0, num_blocks * block_size)``.

    Raises:
        ValueError: naming the slots outside that range.
    """
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if _SLOTS.same((slot_mapping,), (num_slots,)):
        return
    (slots,) = _to_host(slot_mapping)
    bad = slots[(slots < -1) | (slots >= num_slots)]
    if bad.size:
        raise ValueError(f"slot_mapping holds {bad[:8].tolist()} outside [-1, {num_slots}) "
                         f"(-1 is PAD_SLOT_ID; {num_slots} = num_blocks x block_size)")
    _SLOTS.remember((slot_mapping,), (num_slots,))


_SCALES = _LastPassed()


def check_kv_scale_values(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """The fp8 KV cache's ``k_scale``/``v_scale`` (``None`` = 1) are finite and > 0 (one
    read of both; skipped while the same tensors stay unwritten).

    Raises:
        ValueError: naming the scale and its value.
    """
    tensors = tuple(t for t in (k_scale, v_scale) if t is not None)
    if not tensors or _SCALES.same(tensors, ()):
        return
    values = torch.cat([t.detach().reshape(1) for t in tensors]).tolist()
    names = [name for name, t in (("k_scale", k_scale), ("v_scale", v_scale)) if t is not None]
    for name, value in zip(names, values):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be finite and > 0 (x / {name} is what the fp8 cache stores), got {value}")
    _SCALES.remember(tensors, ())
