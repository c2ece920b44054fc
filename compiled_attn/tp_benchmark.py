"""``compiled-attn bench --tensor-parallel-size N``: decode-step time of a DiffLlama sharded
over the ``N`` ranks of a ``torchrun`` (``profiling/bench_tp.py`` runs the same at any size,
1 included, for the TP=1 anchor).

The model is :data:`TP_BENCH_CONFIG` (about 8 B parameters) in bfloat16 on CUDA, compiled
with our CUDA graphs, or :func:`~compiled_attn.models.random_model_config`'s 3 M in float32 on
the CPU (gloo; a smoke test, no graphs). Weights are drawn on the device with one seed on
every rank (normal(0, 0.02), norms 1, λ parameters normal(0, 0.1)), then sharded
(:func:`~compiled_attn.models.sharding.shard_model`). A step's time is the engine's decode
wall time over the decode steps of ``generate`` (``new_tokens`` per prompt of
``prompt_len``), after a warm-up ``generate`` of the same batch.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import torch

from .distributed import TensorParallel
from .engine import Engine
from .models import DiffLlamaConfig, DiffLlamaForCausalLM, random_model_config
from .models.sharding import shard_model
from .ops.arith import cdiv
from .sampling import SamplingParams

TP_BENCH_CONFIG = DiffLlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
    bos_token_id=None, eos_token_id=None,
)
"""About 8 B parameters: hidden 4096, 32 layers, 32 heads (16 pairs) of 128, 8 KV heads."""


def _random_shard(config: DiffLlamaConfig, tp: TensorParallel, device: str, dtype: torch.dtype):
    # Drawn on the device: build_random_model draws float32 weights on the CPU, for 8 B
    # parameters 32 GB and minutes per rank.
    torch.manual_seed(0)
    with torch.device(device):
        model = DiffLlamaForCausalLM(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.1 if ".lambda_" in name else 0.02)
    return shard_model(model.eval().requires_grad_(False), tp)


def run_tp_bench(tp: TensorParallel, batch_sizes: Sequence[int] = (1, 64), prompt_len: int = 512,
                 new_tokens: int = 128, device: str = "cuda", out: str | Path | None = None,
                 log=print) -> list[dict]:
    """Time decode steps at each batch size on this rank's shard; rank 0 logs one JSON line
    per batch size (and appends it to ``out``). Every rank of ``tp`` must call it alike.

    Returns:
        One record per batch size: ``tp``, ``all_reduce``, ``batch``, ``prompt_len``,
        ``new_tokens``, ``step_seconds``, ``device``, ``time``.

    Raises:
        ValueError: ``new_tokens < 2`` (no decode step to time) or an empty ``batch_sizes``.
    """
    if new_tokens < 2 or not batch_sizes:
        raise ValueError(f"need new_tokens >= 2 and at least one batch size, got {new_tokens}, {list(batch_sizes)}")
    cuda = device == "cuda"
    config = TP_BENCH_CONFIG if cuda else random_model_config()
    model = _random_shard(config, tp, device, torch.bfloat16 if cuda else torch.float32)
    if cuda:
        torch.cuda.empty_cache()
    max_batch = max(batch_sizes)
    engine = Engine(model, max_model_len=prompt_len + new_tokens, max_num_seqs=max_batch,
                    num_blocks=max_batch * cdiv(prompt_len + new_tokens, 16) + 8, compile=cuda, cuda_graphs=cuda)
    if tp.rank == 0:  # progress: compiling and capturing the 8 B model takes a while
        log(f"tp={tp.world_size}: engine warmed up in {engine.warmup_seconds:.0f} s")
    records = []
    for batch in batch_sizes:
        prompts = [[(7 * i + j) % config.vocab_size for j in range(prompt_len)] for i in range(batch)]
        engine.generate(prompts, SamplingParams(max_new_tokens=min(4, new_tokens)))  # warm this batch size
        _, timings = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
        records.append(dict(bench="tp_decode", tp=tp.world_size, all_reduce=tp.all_reduce, batch=batch,
                            prompt_len=prompt_len, new_tokens=new_tokens,
                            step_seconds=timings.decode_seconds / timings.decode_steps,
                            device=torch.cuda.get_device_name() if cuda else "cpu",
                            time=time.strftime("%Y-%m-%dT%H:%M:%S")))
        if tp.rank == 0:
            log(json.dumps(records[-1]))
            if out is not None:
                with open(out, "a") as f:
                    f.write(json.dumps(records[-1]) + "\n")
    del engine  # its CUDA graphs hold NCCL work: destroy_process_group hangs while they live
    return records
