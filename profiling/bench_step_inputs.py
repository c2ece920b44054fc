"""Host time of writing one step's inputs into the static buffers that graphs read.

A mixed step of the serving bench's prefix hit (60 new tokens after 1024 cached, two decode
rows fed from the step in flight, greedy) and a decode batch of 16 rows, both with block
tables 1024 blocks wide (a 16k ``max_model_len``), written by
:class:`~compiled_attn.step_inputs.MixedBuffers` / ``DecodeBuffers`` against the anchor
nano-vllm's runner uses: one ``torch.tensor(values, pin_memory=True)`` and one
non-blocking copy per column (``torch.tensor(..., device=cuda)`` on a CPU machine). Host
time per write: median over ``--calls`` writes in a loop (each write waits for the last
one's copies, as the engine's do), microseconds; then cProfile of the mixed writes.

    python profiling/bench_step_inputs.py [--device cuda] [--calls 2000]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from compiled_attn.metadata import SequenceChunk, pack_chunks
from compiled_attn.mixed_graphs import default_mixed_capture_sizes
from compiled_attn.step_inputs import DecodeBuffers, DecodeRow, MixedBuffers

BLOCK = 16
WIDTH = 1024  # block-table width: a 16k max_model_len


def host_us(write, calls: int, device: torch.device) -> float:
    """Median host microseconds of ``write()`` over ``calls`` calls in a loop (in chunks of 50)."""
    for _ in range(50):
        write()
    samples = []
    for _ in range(calls // 50):
        start = time.perf_counter()
        for _ in range(50):
            write()
        samples.append((time.perf_counter() - start) / 50 * 1e6)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return statistics.median(samples)


def per_column_anchor(columns: dict[str, list], buffers: dict[str, torch.Tensor], device: torch.device):
    """nano-vllm's way: a page-locked tensor per column, one non-blocking copy each."""
    pin = device.type == "cuda"

    def write():
        for name, values in columns.items():
            buffer = buffers[name]
            host = torch.tensor(values, dtype=buffer.dtype, pin_memory=pin)
            buffer.view(-1)[: host.numel()].copy_(host.view(-1), non_blocking=True)
    return write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    device = torch.device(args.device)

    mixed = MixedBuffers(default_mixed_capture_sizes(64, 2048), WIDTH, device)
    chunks = [SequenceChunk(list(range(60)), 1024, list(range(1, 70))),
              SequenceChunk([7], 1100, list(range(100, 170))), SequenceChunk([9], 300, list(range(200, 219)))]
    packed = pack_chunks(chunks, BLOCK, WIDTH)
    shape = mixed.padded_shape(packed.num_tokens, packed.num_seqs, 3)
    draws = [(i, 0.0, 1.0, 0, 0) for i in range(3)]
    feed = [(60, 0), (61, 1)]

    def mixed_write():
        mixed.write(packed, shape, draws, greedy=True, feed=feed)

    decode = DecodeBuffers(64, WIDTH, BLOCK, device)
    rows = [DecodeRow(5, 1000 + i, list(range(70 * i, 70 * i + 64)), 0.0, 1.0, 0) for i in range(16)]

    def decode_write():
        decode.write(rows, 16)

    mixed_host = {name: getattr(packed, name) for name in ("input_ids", "positions", "slot_mapping",
                                                           "cu_seqlens_q", "seq_lens")}
    mixed_host["block_table"] = [b for row in packed.block_table for b in row + [0] * (WIDTH - len(row))]
    anchors = {"mixed": per_column_anchor(mixed_host, mixed._staged.buffers, device)}
    print(f"device {device}; mixed shape {shape}; block tables {WIDTH} wide")
    results = {"mixed": (host_us(mixed_write, args.calls, device), host_us(anchors["mixed"], args.calls, device)),
               "decode B=16": (host_us(decode_write, args.calls, device), None)}
    for name, (ours, anchor) in results.items():
        ratio = f", per-column pinned copies {anchor:.1f} us (ratio {ours / anchor:.2f})" if anchor else ""
        print(f"{name}: {ours:.1f} us a write{ratio}")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(500):
        mixed_write()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(14)
    print(text.getvalue())


if __name__ == "__main__":
    main()
