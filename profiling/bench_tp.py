"""Decode step time of a random DiffLlama at tensor-parallel size = WORLD_SIZE (issue 14).

    torchrun --nproc-per-node 1 profiling/bench_tp.py --out profiling/results/tp_decode.jsonl
    torchrun --nproc-per-node 2 profiling/bench_tp.py --out profiling/results/tp_decode.jsonl
    torchrun --nproc-per-node 2 profiling/bench_tp.py --all-reduce symm_mem --out profiling/results/tp_decode.jsonl

Default config: ~8 B parameters (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate
14336, vocab 128256), bfloat16, weights drawn on the GPU (normal(0, 0.02), same seed on every
rank, then :func:`~compiled_attn.models.sharding.shard_model`). ``--all-reduce`` picks the
all-reduce's kind (``init_tensor_parallel``; one kind per process). Rank 0 appends one JSON
line per batch size: the kind and the mean decode step seconds (Engine decode time / decode
steps).
``--tiny`` runs a small config on the CPU (gloo) as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from compiled_attn.distributed import ALL_REDUCE_KINDS, destroy_tensor_parallel, init_tensor_parallel
from compiled_attn.engine import Engine
from compiled_attn.models import DiffLlamaConfig, DiffLlamaForCausalLM
from compiled_attn.models.sharding import shard_model
from compiled_attn.ops.arith import cdiv
from compiled_attn.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--all-reduce", choices=("auto", *ALL_REDUCE_KINDS), default=None,
                        help="the all-reduce's kind (default: $COMPILED_ATTN_ALL_REDUCE, else auto)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cuda = not args.tiny
    tp = init_tensor_parallel(backend="nccl" if cuda else "gloo", all_reduce=args.all_reduce)
    if args.tiny:
        config = DiffLlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                 max_position_embeddings=1024, bos_token_id=None, eos_token_id=None)
    else:
        config = DiffLlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=4096, bos_token_id=None, eos_token_id=None)
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    with torch.device(device):
        model = DiffLlamaForCausalLM(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.1 if ".lambda_" in name else 0.02)
    model = shard_model(model.eval().requires_grad_(False), tp)
    if cuda:
        torch.cuda.empty_cache()
    max_batch = max(args.batch_sizes)
    engine = Engine(model, max_model_len=args.prompt_len + args.new_tokens, max_num_seqs=max_batch,
                    num_blocks=max_batch * cdiv(args.prompt_len + args.new_tokens, 16) + 8,
                    compile=True, cuda_graphs=cuda)
    if tp.rank == 0:  # progress: compiling and capturing the 8 B model takes a while
        print(f"tp={tp.world_size}: engine warmed up in {engine.warmup_seconds:.0f} s", flush=True)
    for batch in args.batch_sizes:
        prompts = [[(7 * i + j) % config.vocab_size for j in range(args.prompt_len)] for i in range(batch)]
        params = SamplingParams(max_new_tokens=args.new_tokens)
        engine.generate(prompts, SamplingParams(max_new_tokens=4))  # warm this batch size
        _, timings = engine.generate(prompts, params)
        step = timings.decode_seconds / (args.new_tokens - 1)
        row = dict(bench="tp_decode", tp=tp.world_size, all_reduce=tp.all_reduce, batch=batch,
                   prompt_len=args.prompt_len, new_tokens=args.new_tokens, step_seconds=step,
                   device=torch.cuda.get_device_name() if cuda else "cpu", time=time.strftime("%Y-%m-%dT%H:%M:%S"))
        if tp.rank == 0:
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    del engine  # its CUDA graphs hold NCCL work: destroy_process_group hangs while they live
    destroy_tensor_parallel()


if __name__ == "__main__":
    main()
