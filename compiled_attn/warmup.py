"""What :meth:`Engine.warmup <compiled_attn.engine.Engine.warmup>` runs ahead of the first
request: the synthetic batches that make every kernel variant a request can reach compile
(Dynamo, Inductor, Triton) before requests arrive."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .layers import Attention, DifferentialAttention
from .ops.backends import TRITON_AVAILABLE

if TYPE_CHECKING:
    from .engine import Engine


def fits(engine: Engine, num_seqs: int, prompt_len: int, new_tokens: int) -> bool:
    """Whether ``num_seqs`` requests of ``prompt_len + new_tokens`` tokens fit ``engine``
    at once, whole and without preemption."""
    return (num_seqs <= engine.max_num_seqs and prompt_len + new_tokens <= engine.max_model_len
            and num_seqs * engine.scheduler.blocks_reserved(prompt_len, new_tokens)
            <= engine.kv_cache.allocator.num_blocks)


def warmup_batches(engine: Engine) -> list[tuple[int, int, int, bool]]:
    """``(num_seqs, prompt_len, max_new_tokens, paged)`` of ``engine``'s warm-up batches
    (``paged``: its prefill runs the paged kernel, see :attr:`ModelRunner.paged_prefill
    <compiled_attn.model_runner.ModelRunner.paged_prefill>`).

    Every batch fits the engine's limits at once (:func:`fits`) and runs with the prefix
    cache off (so that each prefill runs whole). Prefill candidates: every ``num_seqs`` up
    to ``max_num_seqs`` with prompts of 1..3 tokens, powers of two and one past them (where
    tile sizes change) and a 10% geometric grid between (where split counts change), that
    fit the cache with a decode step to spare. Decode candidates: the batch sizes no CUDA
    graph serves. :func:`~compiled_attn.ops.triton_kernels.attention.distinct_variants`
    keeps the first batch of each kernel variant, per kind of attention layer.
    """
    batches = [(1, 1, 2, False) if fits(engine, 1, 1, 2) else (1, 1, 1, False)]  # a prefill and a decode step
    if engine.device.type == "cuda" and TRITON_AVAILABLE:
        from .ops.triton_kernels.attention import distinct_variants

        max_len, max_seqs = engine.max_model_len, engine.max_num_seqs
        powers = [1 << i for i in range(max_len.bit_length())]
        geometric = [round(1.1 ** i) for i in range(int(math.log(max_len, 1.1)) + 1)]
        lengths = sorted({1, 2, 3, *powers, *(p + 1 for p in powers), *geometric})
        prefills = [(b, b * n) for b in range(1, max_seqs + 1) for n in lengths if fits(engine, b, n, 1)]
        graphed = engine.runner.capture_sizes[-1] if engine.cuda_graphs else 0
        decodes = [(b, b) for b in range(graphed + 1, max_seqs + 1) if fits(engine, b, 1, 2)]
        config = engine.local_config
        heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        max_kv_len = engine.max_blocks_per_seq * engine.kv_cache.block_size
        for differential in {isinstance(m, DifferentialAttention) for m in engine.model.modules()
                             if isinstance(m, Attention)}:
            variant = dict(differential=differential, dtype=engine.dtype, device=engine.device)
            if engine.kv_cache_dtype != torch.float8_e4m3fn:  # an fp8 cache's prefills are paged anyway
                batches += [(b, t // b, 1, False) for b, t in distinct_variants(prefills, *heads, **variant)]
            batches += [(b, t // b, 1, True)
                        for b, t in distinct_variants(prefills, *heads, **variant, max_kv_len=max_kv_len)]
            batches += [(b, 1, 2, False)
                        for b, _ in distinct_variants(decodes, *heads, **variant, max_kv_len=max_kv_len)]
    return [batch for batch in dict.fromkeys(batches) if fits(engine, *batch[:3])]
