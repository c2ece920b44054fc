"""Decode step time of a random DiffLlama at tensor-parallel size = WORLD_SIZE (issue 14):
:func:`compiled_attn.tp_benchmark.run_tp_bench` (``compiled-attn bench
--tensor-parallel-size N`` runs it for N > 1; this script also at N = 1, the anchor).

    torchrun --nproc-per-node 1 profiling/bench_tp.py --out profiling/results/tp_decode.jsonl
    torchrun --nproc-per-node 2 profiling/bench_tp.py --out profiling/results/tp_decode.jsonl
    torchrun --nproc-per-node 2 profiling/bench_tp.py --all-reduce nccl --out profiling/results/tp_decode.jsonl

``--all-reduce`` picks the all-reduce's kind (``init_tensor_parallel``; one kind per
process). ``--tiny`` runs the 3 M random model on the CPU (gloo) as a smoke test.
"""

from __future__ import annotations

import argparse

from compiled_attn.distributed import ALL_REDUCE_KINDS, destroy_tensor_parallel, init_tensor_parallel
from compiled_attn.tp_benchmark import run_tp_bench


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
    tp = init_tensor_parallel(backend="gloo" if args.tiny else "nccl", all_reduce=args.all_reduce)
    try:
        run_tp_bench(tp, args.batch_sizes, args.prompt_len, args.new_tokens, "cpu" if args.tiny else "cuda",
                     args.out)
    finally:
        destroy_tensor_parallel()


if __name__ == "__main__":
    main()
