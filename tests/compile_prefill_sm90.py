"""Compile the Hopper prefill kernel at its real tiles for sm90 (H100/H200) without a GPU.

Run as a script in a process without ``TRITON_INTERPRET``: :func:`varlen_prefill` runs on
small CPU tensors with its launches recorded instead of made (as ``compile_sm90.py``), at
the :data:`HOPPER_TILES` of each case and with TMA descriptors on, and paged at
:data:`PAGED_TILES` (:data:`PAGED_CASES`), plus the sweeps' ``overlap`` tiles (case
names end in `` sweep``); each recorded launch goes through
``triton.compile`` for sm90 down to the cubin, then Triton's bundled ``ptxas -v`` reports
registers and spills of the PTX. Prints one JSON list of ``{case, tiles, shared,
registers, spill_stores, spill_loads, wgmma_serialized}``.

    python tests/compile_prefill_sm90.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from compile_sm90 import compile_launches, record_launches  # noqa: E402


def recorded_launches() -> list[tuple[str, object, dict, dict]]:
    """``(case, kernel, arguments by name, options)``: bf16 causal prefill at the Hopper
    tiles, plain and differential, D 64 and 128 (D 256 plain), GQA 4; and paged prefill at
    :data:`PAGED_CASES`."""
    from compiled_attn.ops.triton_kernels import prefill

    launches, case = [], [""]
    record_launches(launches, case)
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 100, 356], dtype=torch.int32)
    overlap = {key: [t for t in tiles if t.overlap] for key, tiles in prefill.SWEEP_TILES.items()}
    for (head_size, differential), tiles in prefill.HOPPER_TILES.items():
        for every in (tiles, *overlap[head_size, differential]):
            case[0] = f"{'differential' if differential else 'plain'} d{head_size} bf16"
            case[0] += " sweep" if every is not tiles else ""
            q = torch.randn(356, 32, head_size, generator=g).to(torch.bfloat16)
            kv = torch.randn(356, 8, head_size, generator=g).to(torch.bfloat16)
            lam = torch.full((16,), 0.5) if differential else None
            prefill.varlen_prefill(q, kv, kv, cu, cu, lam, tiles=every, use_tma=True)
    paged_overlap = {key: [t for t in tiles if t.overlap] for key, tiles in prefill.PAGED_SWEEP_TILES.items()}
    for block_size, only in PAGED_CASES:
        for (head_size, differential), tiles in prefill.PAGED_TILES.items():
            if only is not None and (head_size, differential) not in only:
                continue
            for every in (tiles, *(paged_overlap[head_size, differential] if block_size == 16 else ())):
                case[0] = f"paged b{block_size} {'differential' if differential else 'plain'} d{head_size} bf16"
                case[0] += " sweep" if every is not tiles else ""
                q = torch.randn(356, 32, head_size, generator=g).to(torch.bfloat16)
                cache = torch.randn(64, block_size, 8, head_size, generator=g).to(torch.bfloat16)
                table = torch.randperm(64, generator=g).to(torch.int32).view(2, 32)
                seq_lens = torch.tensor([1124, 1380], dtype=torch.int32)
                lam = torch.full((16,), 0.5) if differential else None
                prefill.paged_prefill(q, cache, cache, cu, seq_lens, table, lam, tiles=every, use_tma=True)
    return launches


# Paged prefill (``prefill.paged_prefill``: K/V by pointer loads from the tile's blocks):
# block 16 (the engine's) at every PAGED_TILES case; blocks 64 and 256 (a tile in one or
# in several blocks without the broadcast of ids) at plain D 128.
PAGED_CASES = ((16, None), (64, {(128, False)}), (256, {(128, False)}))


def main() -> None:
    from compiled_attn.ops.triton_kernels import prefill

    launches = recorded_launches()
    report = []
    for (case, _, kwargs, options), usage in zip(launches, compile_launches(launches)):
        tiles = prefill.PrefillTiles(kwargs["BLOCK_M"], kwargs["BLOCK_N"], options["num_warps"],
                                     options["num_stages"], kwargs["VALUE_SPLIT"], kwargs["OVERLAP"],
                                     kwargs["SEQUENTIAL"]).label()
        report.append({"case": case, "tiles": tiles, **usage})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
