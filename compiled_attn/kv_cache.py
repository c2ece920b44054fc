"""Paged KV cache: the per-layer cache tensors and the block allocator that addresses them.

Layout (one for every layer, as vLLM's): ``key_cache, value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_size]``; block ids, slots and the prefix cache
are :mod:`compiled_attn.block_allocator`'s.

Cache tensors are *static addresses* (:func:`allocate_kv_caches`): allocated once and marked
with ``torch._dynamo.mark_static_address``, so that Inductor's own CUDA graphs
(``torch.compile(mode="reduce-overhead")``) record the ops that write them instead of
skipping the graph ("skipping cudagraphs due to mutated inputs").

fp8 KV cache (vLLM's ``kv_cache_dtype="fp8"``/``"fp8_e4m3"``): the caches are
float8_e4m3fn, half the bytes of bfloat16 (twice the tokens in the same memory), and each
layer's entry is ``(key_cache, value_cache, k_scale, v_scale)`` with float32 0-d scales
(static addresses too): the cache holds ``x / scale`` and attention reads
``cache * scale`` (see :func:`compiled_attn.ops.reshape_and_cache`). Scales are 1 by
default or come from :func:`calibrate_kv_scales` (``max |k| / 448`` per layer over
calibration prompts; vLLM's ``calculate_kv_scales`` divides by 200 and 100 instead).
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .block_allocator import BlockAllocator, OutOfBlocksError
from .distributed import all_reduce_max
from .ops.arith import cdiv
from .ops.validation import FP8_DTYPE, FP8_MAX
from .tokenizer import check_token_ids

__all__ = ["KV_CACHE_DTYPES", "BlockAllocator", "KVCache", "OutOfBlocksError", "allocate_kv_caches",
           "calibrate_kv_scales", "resolve_kv_cache_dtype"]

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""Values of ``kv_cache_dtype`` (vLLM's names): ``"auto"`` = the model's dtype; ``"fp8"``
and its alias ``"fp8_e4m3"`` = float8_e4m3fn with per-layer scales."""
K_SCALE_CONSTANT = 200.0  # what calibrate_kv_scales maps the largest key to (vLLM's constant)
V_SCALE_CONSTANT = 100.0  # ... and the largest value


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache for ``kv_cache_dtype`` (one of :data:`KV_CACHE_DTYPES`).

    Raises:
        ValueError: any other value, naming the argument and the allowed values.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))} "
                         f"('auto' = the model's dtype), got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else FP8_DTYPE


def _check_kv_scales(kv_scales, num_layers: int) -> list[tuple[float, float]]:
    """``kv_scales`` as ``num_layers`` ``(k_scale, v_scale)`` floats; ``None``: all 1."""
    if kv_scales is None:
        return [(1.0, 1.0)] * num_layers
    try:
        scales = [tuple(pair) for pair in kv_scales]
    except TypeError:
        raise TypeError(f"kv_scales must be a sequence of (k_scale, v_scale) pairs, got {kv_scales!r:.120}") from None
    if len(scales) != num_layers or any(len(pair) != 2 for pair in scales):
        raise ValueError(f"kv_scales must hold one (k_scale, v_scale) pair per cache layer ({num_layers}), "
                         f"got {kv_scales!r:.120}")
    for layer, pair in enumerate(scales):
        for name, value in zip(("k_scale", "v_scale"), pair):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"kv_scales[{layer}]: {name} must be a real number, got {type(value).__name__} "
                                f"{value!r}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"kv_scales[{layer}]: {name} must be finite and > 0, got {value!r}")
    return [(float(k), float(v)) for k, v in scales]


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int, dtype: torch.dtype, device: torch.device | str,
                       kv_scales: Sequence[tuple[float, float]] | None = None) -> list[tuple[torch.Tensor, ...]]:
    """``num_layers`` zero-filled ``(key_cache, value_cache)`` pairs of shape ``[num_blocks,
    block_size, num_kv_heads, head_size]``, each marked as a static address for
    ``torch.compile`` (unguarded: a different cache tensor re-records a CUDA graph rather than
    recompiling). Use it for a model of your own too; see the README ("Bring your own model").

    With ``dtype=torch.float8_e4m3fn`` (an fp8 KV cache) each entry is ``(key_cache,
    value_cache, k_scale, v_scale)``: the scales are float32 0-d tensors on ``device`` from
    ``kv_scales`` (one ``(k_scale, v_scale)`` pair per layer, e.g. from
    :func:`calibrate_kv_scales`; default 1.0), which the layers pass to the ops.

    Raises:
        ValueError: a size below 1; ``kv_scales`` of the wrong length or with a value that is
            not finite and > 0, or given for a cache that is not fp8.
    """
    sizes = dict(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                 num_kv_heads=num_kv_heads, head_size=head_size)
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if kv_scales is not None and dtype != FP8_DTYPE:
        raise ValueError(f"kv_scales apply to an fp8 ({FP8_DTYPE}) cache only, the cache dtype is {dtype}")
    scales = _check_kv_scales(kv_scales, num_layers) if dtype == FP8_DTYPE else None  # before allocating
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(num_layers)]
    if scales is not None:
        caches = [(*pair, *(torch.tensor(s, dtype=torch.float32, device=device) for s in layer_scales))
                  for pair, layer_scales in zip(caches, scales)]
    for pair in caches:
        for cache in pair:
            torch._dynamo.mark_static_address(cache)
    return caches


@torch.no_grad()
def calibrate_kv_scales(model: torch.nn.Module, prompts: Sequence[Sequence[int]], block_size: int = 16,
                        k_range: float = K_SCALE_CONSTANT, v_range: float = V_SCALE_CONSTANT) -> list[tuple[float, float]]:
    """Per-layer fp8 KV-cache scales from calibration prompts: ``k_scale = max |k| / k_range``
    and ``v_scale = max |v| / v_range`` over every key and value (RoPE applied, as cached)
    that each cache-owning layer writes while ``model`` prefills ``prompts`` in one batch.
    This is vLLM's ``calculate_kv_scales`` with its ``K_SCALE_CONSTANT = 200`` and
    ``V_SCALE_CONSTANT = 100``: the largest key seen maps to 200 and the largest value to
    100 of e4m3's 448, which leaves headroom for later tokens larger than the calibration's
    (beyond ``448 * scale`` they saturate). Default model, float32, calibrated on a one-token
    prompt, greedy: the largest logit error against the unquantized cache was 11% of the
    logits' range with ``k_range = v_range = 448`` and 3.6% with 200 / 100 (3.6% at
    scale 1.0). A layer whose keys (values) are all zero gets 1.0. Runs the model once,
    eagerly, over a temporary cache of its dtype.

    Args:
        model: a model with ``forward(md, kv_caches)``, ``config`` (``num_key_value_heads``,
            ``head_dim``, ``vocab_size``) and ``num_cache_layers``, as :class:`~compiled_attn.Engine` takes.
        prompts: token-id lists, each non-empty, every id in ``[0, vocab_size)``.
        block_size: block size of the temporary cache.
        k_range, v_range: what the largest key / value magnitude maps to, > 0 and at most 448.

    Returns:
        ``num_cache_layers`` ``(k_scale, v_scale)`` float pairs, for
        ``Engine(..., kv_cache_dtype="fp8", kv_scales=...)`` or :func:`allocate_kv_caches`.

    Raises:
        TypeError: a token id that is not an integer.
        ValueError: no prompts, an empty prompt or a token id outside ``[0, vocab_size)``
            (before the model runs); a range outside ``(0, 448]``; non-finite keys or values.
    """
    from .metadata import SequenceChunk, build_metadata

    try:
        prompts = [[operator.index(t) for t in p] for p in prompts]
    except TypeError:
        raise TypeError(f"prompts must be lists of integer token ids, got {prompts!r:.120}") from None
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    for i, prompt in enumerate(prompts):
        check_token_ids(prompt, model.config.vocab_size, f"prompts[{i}]")
    for name, value in (("k_range", k_range), ("v_range", v_range)):
        if not 0 < value <= FP8_MAX:
            raise ValueError(f"{name} must lie in (0, {FP8_MAX:g}], got {value}")
    param = next(model.parameters())
    config = getattr(model, "tp_config", model.config)  # a tensor-parallel shard caches its own KV heads
    blocks = [cdiv(len(p), block_size) for p in prompts]
    caches = allocate_kv_caches(model.num_cache_layers, sum(blocks), block_size, config.num_key_value_heads,
                                config.head_dim, param.dtype, param.device)
    chunks, first = [], 0
    for prompt, n in zip(prompts, blocks):
        chunks.append(SequenceChunk(prompt, 0, list(range(first, first + n))))
        first += n
    md = build_metadata(chunks, block_size, max(blocks), param.device, sum(blocks))
    model(md, caches)
    # [layers, 2] largest |k|, |v| per layer (unwritten slots hold zeros); over the KV heads of
    # every rank for a tensor-parallel shard, so that all ranks get the unsharded model's scales
    peaks = torch.stack([torch.stack([k.abs().max(), v.abs().max()]).float() for k, v in caches])
    tp = getattr(model, "tp", None)
    if tp is not None:
        peaks = all_reduce_max(peaks, tp)
    scales = []
    for layer, layer_peaks in enumerate(peaks.tolist()):
        if not all(math.isfinite(p) for p in layer_peaks):
            raise ValueError(f"calibrate_kv_scales: cache layer {layer} has non-finite keys or values")
        scales.append(tuple(p / r if p > 0 else 1.0 for p, r in zip(layer_peaks, (k_range, v_range))))
    return scales


@dataclass
class KVCache:
    """Per-layer paged K/V tensors plus their allocator.

    Attributes:
        layers: one ``(key_cache, value_cache)`` pair per cache-owning layer, each
            ``[num_blocks, block_size, num_kv_heads, head_size]``; for an fp8 cache
            ``(key_cache, value_cache, k_scale, v_scale)`` (float32 0-d scales).
        allocator: the shared :class:`BlockAllocator` (all layers use the same block ids).
    """

    layers: list[tuple[torch.Tensor, ...]]
    allocator: BlockAllocator = field(repr=False)

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_size: int, dtype: torch.dtype, device: torch.device | str,
                 prefix_caching: bool = False,
                 kv_scales: Sequence[tuple[float, float]] | None = None) -> "KVCache":
        """Allocate ``num_layers`` zero-filled cache pairs of ``num_blocks`` blocks (static
        addresses, see :func:`allocate_kv_caches`; ``dtype=torch.float8_e4m3fn``: fp8 caches
        with their ``kv_scales``, default 1) and their allocator (with or without
        ``prefix_caching``)."""
        layers = allocate_kv_caches(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype, device,
                                    kv_scales)
        return cls(layers, BlockAllocator(num_blocks, block_size, prefix_caching))

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block costs over all layers, keys and values."""
        return 2 * num_layers * block_size * num_kv_heads * head_size * dtype.itemsize
