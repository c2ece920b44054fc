"""``fused_linear`` at the bench model's projection shapes, on the GPU.

Per shape and row count: the weight-read bandwidth of ``fused_linear`` (the fused GEMV up
to ``GEMV_MAX_ROWS`` rows, cuBLAS between our norm and SwiGLU kernels above) against the
device-to-device copy bandwidth, and cuBLAS ``F.linear`` (the GEMM alone, without the
norm / SwiGLU / residual) against it. Each timed graph runs the op over enough weight
copies (>= 256 MiB) that nothing is served from L2, as in a decode step that streams ~2 GB
of weights; times are per call. ``--sweep SECONDS`` also tries tile configurations for
that long and prints the best per case. Appends to ``profiling/results/linear.md`` and
``linear.jsonl``.

    python profiling/bench_linear.py [--results-dir profiling/results] [--sweep 180]
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from compiled_attn.benchmark import copy_bandwidth
from compiled_attn.ops import fused_linear, triton_kernels
from compiled_attn.ops.arith import cdiv
from compiled_attn.ops.triton_kernels.linear_kernel import GEMV_MAX_ROWS, LinearTiles, choose_linear_tiles
from compiled_attn.results import ResultRow, write_results

DTYPE = torch.bfloat16
# name: (out_features, in_features, norm, silu_and_mul, residual), ~1.1B DiffLlama bench model
SHAPES = {
    "gate_up": (8192, 2048, True, True, False),
    "down": (2048, 8192, False, False, True),
    "qkv": (3072, 2048, True, False, False),
    "o_proj": (2048, 2048, False, False, True),
    "lm_head": (32000, 2048, True, False, False),
}
ROWS = (1, 2, 4, 8, 16, 64)
STREAM_BYTES = 256 << 20


class Case:
    """Weight copies of one shape (>= ``STREAM_BYTES`` in all) and the inputs of ``rows`` rows."""

    def __init__(self, name: str, rows: int) -> None:
        out_features, in_features, norm, self.silu_and_mul, residual = SHAPES[name]
        weight_rows = 2 * out_features if self.silu_and_mul else out_features
        self.weight_bytes = weight_rows * in_features * 2
        copies = max(2, cdiv(STREAM_BYTES, self.weight_bytes))
        self.weights = [torch.randn(weight_rows, in_features, dtype=DTYPE, device="cuda") * in_features ** -0.5
                        for _ in range(copies)]
        self.x = torch.randn(rows, in_features, dtype=DTYPE, device="cuda")
        self.norm_weight = torch.rand(in_features, dtype=DTYPE, device="cuda") + 0.5 if norm else None
        self.residual = torch.randn(rows, out_features, dtype=DTYPE, device="cuda") if residual else None

    def per_call_ms(self, call) -> float:
        total = do_bench_cudagraph(lambda: [call(w) for w in self.weights], rep=50, return_mode="median")
        return total / len(self.weights)

    def ours(self, tiles: LinearTiles | None = None):
        return lambda w: triton_kernels.fused_linear(self.x, w, None, self.norm_weight, 1e-5, self.residual,
                                                     self.silu_and_mul, tiles=tiles)

    def op(self, w):
        return fused_linear(self.x, w, norm_weight=self.norm_weight, norm_eps=1e-5, residual=self.residual,
                            silu_and_mul=self.silu_and_mul)

    def cublas(self, w):
        return F.linear(self.x, w)


def bench_rows(bandwidth: float) -> list[ResultRow]:
    rows = []
    for name, count in itertools.product(SHAPES, ROWS):
        case = Case(name, count)
        torch.testing.assert_close(case.op(case.weights[0]), case.ours()(case.weights[0]), rtol=0, atol=0)
        ours = case.per_call_ms(case.op)
        cublas = case.per_call_ms(case.cublas)
        label = f"{name} M={count}"
        rows.append(ResultRow(f"{label} ours", "weight TB/s", case.weight_bytes / ours / 1e9,
                              "copy TB/s", bandwidth / 1e12))
        rows.append(ResultRow(f"{label} cuBLAS (GEMM only) / ours", "ms", cublas, "ours ms", ours))
    return rows


def sweep(seconds: float, bandwidth: float) -> None:
    """Try tile configurations per case until ``seconds`` pass; print the best of each."""
    deadline = time.perf_counter() + seconds
    configs = [LinearTiles(0, bn, bk, warps, 1) for bn, bk, warps in
               itertools.product((2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8))]
    print("== sweep: case, heuristic tiles and TB/s, best tiles and TB/s")
    for count, name in itertools.product((1, GEMV_MAX_ROWS, 4, 2), SHAPES):
        case = Case(name, count)
        heuristic = choose_linear_tiles(count, SHAPES[name][0], SHAPES[name][1], case.silu_and_mul)
        results = {}
        for tiles in [heuristic] + [c._replace(block_m=heuristic.block_m) for c in configs]:
            if time.perf_counter() > deadline:
                print("sweep: out of time")
                return
            products = tiles.block_m * tiles.block_n * tiles.block_k * (2 if case.silu_and_mul else 1)
            if tiles in results or products > 64 * 32 * tiles.num_warps:  # > 64 float32 registers a thread
                continue
            try:
                results[tiles] = case.weight_bytes / case.per_call_ms(case.ours(tiles)) / 1e9
            except Exception as error:  # out of shared memory or registers: skip the config
                print(f"  {name} M={count} {tuple(tiles)}: {type(error).__name__}")
        best = max(results, key=results.get)
        print(f"{name} M={count}: heuristic {tuple(heuristic)} {results[heuristic]:.2f} TB/s; "
              f"best {tuple(best)} {results[best]:.2f} TB/s (copy {bandwidth / 1e12:.2f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", default="profiling/results")
    parser.add_argument("--sweep", type=float, default=0.0, metavar="SECONDS",
                        help="also sweep tile configurations for this long")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(write_results(bench_rows(bandwidth), args.results_dir, "linear",
                        f"fused_linear, bf16, bench-model shapes; copy {bandwidth / 1e12:.2f} TB/s"))
    if args.sweep:
        sweep(args.sweep, bandwidth)


if __name__ == "__main__":
    main()
