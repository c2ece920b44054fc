"""A/B of an edit of the Gluon prefill kernel in one process: the kernel and tiles of the
tree (``ops/triton_kernels/gluon_prefill_kernel.py``, the launchers' default tiles) against a
variant, another copy of that file (``--kernel``) and/or other tile fields (``--tiles``),
each case's two timed in turns (``bench_kernels._alternated_ms``: a drift of the GPU's
clocks weighs on both alike), with the variant's largest difference from the tree's result.

Cases (bf16, causal, Hq 32, Hkv 8, D 128): plain and differential at B=8 S=2048 and on 64
sequences of 128-4096 tokens (``bench_kernels._varlen_batches``); plain at B=1 S=4096, B=4
S=2048, B=1 S=16384 and on 16 sequences of 128-1024 tokens; plain paged (8 sequences of 512
new tokens after 4096 cached, block 16). Prints one table (milliseconds, variant / tree);
writes no results (a variant that wins becomes the tree's default, and ``bench_kernels.py
--parts gluon`` measures it against flash-attn 4).

    python profiling/gluon_ab.py [--kernel VARIANT.py] [--tiles dynamic=True ...] [--rounds 3]
        [--cases "B=8 S=2048 plain" ...]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from unittest import mock

from bench_kernels import BLOCK, D, _alternated_ms, _scaled_diff, _varlen_batches, _varlen_inputs, \
    paged_prefill_inputs, short_varlen_batch
from compiled_attn.ops.triton_kernels import gluon_prefill


def load_variant(path: Path):
    """The variant file as a module of its own (its ``gluon_prefill_kernel``)."""
    spec = importlib.util.spec_from_file_location("gluon_prefill_kernel_variant", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_field(field: str) -> tuple[str, int | bool]:
    """``"dynamic=True"`` -> ``("dynamic", True)``; values ``True``, ``False`` or digits.
    Raises ValueError otherwise."""
    name, _, value = field.partition("=")
    if value in ("True", "False"):
        return name, value == "True"
    if value.isdigit():
        return name, int(value)
    raise ValueError(f"--tiles {field!r}: expected FIELD=True, FIELD=False or FIELD=<digits>")


def cases() -> dict[str, tuple]:
    """``name -> (launcher, args, tiles)`` of the cases in the module docstring, the tiles
    those the launcher picks for it (``gluon_prefill.default_tiles``)."""
    batches = _varlen_batches()
    out = {}
    more = {"B=1 S=4096": [4096], "B=4 S=2048": [2048] * 4, "B=1 S=16384": [16384],
            "16 seqs 128-1024": short_varlen_batch()}
    for case, lens in (*batches.items(), *more.items()):
        q, k, v, cu, lam = _varlen_inputs(lens)
        out[f"{case} plain"] = (gluon_prefill.varlen_prefill, (q, k, v, cu, cu),
                                gluon_prefill.default_tiles(q, len(lens), False, False))
        if case in batches:
            out[f"{case} differential"] = (gluon_prefill.varlen_prefill, (q, k, v, cu, cu, lam),
                                           gluon_prefill.default_tiles(q, len(lens), True, False))
    paged = paged_prefill_inputs(8, 512, 4096)
    out[f"paged 512 after 4096 block {BLOCK} plain"] = (gluon_prefill.paged_prefill, paged,
                                                        gluon_prefill.default_tiles(paged[0], 8, False, True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", type=Path, help="a copy of gluon_prefill_kernel.py with the edit")
    parser.add_argument("--tiles", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="GluonTiles fields of the variant (e.g. dynamic=True early_waits=False)")
    parser.add_argument("--rounds", type=int, default=3, help="timings of each kernel a case, in turns")
    parser.add_argument("--cases", nargs="+", help="names of the cases to run (default: all)")
    args = parser.parse_args()
    kernel = load_variant(args.kernel).gluon_prefill_kernel if args.kernel else None
    fields = dict(parse_field(field) for field in args.tiles)

    def run_variant(grid, launch_args, constexprs):
        kernel[grid](*launch_args, **constexprs, num_warps=4)

    def on_variant(launcher, call_args, tiles):
        tiles = tiles._replace(**fields)
        if kernel is None:
            return launcher(*call_args, tiles=tiles)
        with mock.patch.object(gluon_prefill, "_run", run_variant):
            return launcher(*call_args, tiles=tiles)

    print(f"{'case':44} {'tree ms':>9} {'variant ms':>10} {'ratio':>7} {'max diff':>9}")
    for name, (launcher, call_args, tiles) in cases().items():
        if args.cases and name not in args.cases:
            continue
        diff = _scaled_diff(on_variant(launcher, call_args, tiles), launcher(*call_args))
        tree, alt = _alternated_ms(lambda: launcher(*call_args), lambda: on_variant(launcher, call_args, tiles),
                                   args.rounds)
        print(f"{name:44} {tree:9.4f} {alt:10.4f} {alt / tree:7.3f} {diff:9.2e}", flush=True)


if __name__ == "__main__":
    main()
