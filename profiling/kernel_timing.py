"""First timings of the Triton attention kernels, as ratios to anchors measured in the same run.

Anchors: device-to-device copy bandwidth (bytes read + written), PyTorch SDPA (flash and
cuDNN backends) for prefill, the plain kernel for the differential one, and the seed's
four-call differential formulation (four plain calls over strided head views). Decode runs
are captured in a CUDA graph and replayed (``do_bench_cudagraph``), prefill runs are timed
eagerly (``do_bench``); medians. KV working sets are >= 256 MiB, well above the L2.

    python profiling/kernel_timing.py --out timing.md
"""

from __future__ import annotations

import argparse
import datetime

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

from compiled_attn.ops import triton_kernels

DTYPE = torch.bfloat16
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    src = torch.randn(1 << 30, dtype=DTYPE, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def decode_inputs(batch: int, context: int, num_heads: int):
    blocks = context // BLOCK_SIZE
    shape = (batch * blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    key_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    value_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    table = torch.randperm(batch * blocks, device="cuda").reshape(batch, blocks).int()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, num_heads, HEAD_SIZE, dtype=DTYPE, device="cuda")
    return query, key_cache, value_cache, cu, seq_lens, table


def seed_four_calls(query, key_cache, value_cache, cu, seq_lens, table, lam):
    """The seed's differential: four plain calls (q_i, k_i, v_j) on strided head views."""
    parts = [[triton_kernels.paged_attention(query[:, i::2], key_cache[:, :, i::2],
                                             value_cache[:, :, j::2], cu, seq_lens, table)
              for j in (0, 1)] for i in (0, 1)]
    first, second = torch.cat(parts[0], dim=-1), torch.cat(parts[1], dim=-1)
    return first - lam[:, None] * second


def decode_rows(bandwidth: float):
    rows = []
    for batch, context in [(2, 32768), (8, 8192), (16, 4096), (32, 4096), (64, 2048), (128, 1024)]:
        args = decode_inputs(batch, context, NUM_HEADS)
        lam = torch.rand(NUM_HEADS // 2, device="cuda")
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_SIZE * args[1].element_size()
        plain = do_bench_cudagraph(lambda: triton_kernels.paged_attention(*args), rep=100,
                                   return_mode="median")
        diff = do_bench_cudagraph(lambda: triton_kernels.paged_attention(*args, lam), rep=100,
                                  return_mode="median")
        seed = do_bench_cudagraph(lambda: seed_four_calls(*args, lam), rep=100,
                                  return_mode="median")
        name = f"decode B={batch} ctx={context}"
        rows.append((f"{name} plain", plain, f"{kv_bytes / (plain * 1e-3) / 1e12:.2f} TB/s",
                     f"{kv_bytes / (plain * 1e-3) / bandwidth:.2f} x copy"))
        rows.append((f"{name} differential", diff, f"{kv_bytes / (diff * 1e-3) / 1e12:.2f} TB/s",
                     f"{diff / plain:.2f} x plain time; seed 4-call {seed / diff:.2f} x ours"))
    return rows


def prefill_rows():
    batch, seq = 8, 2048
    q = torch.randn(batch * seq, NUM_HEADS, HEAD_SIZE, dtype=DTYPE, device="cuda")
    k = torch.randn(batch * seq, NUM_KV_HEADS, HEAD_SIZE, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * seq
    lam = torch.rand(NUM_HEADS // 2, device="cuda")
    flops = 4 * batch * NUM_HEADS * seq * seq * HEAD_SIZE / 2  # causal: half the scores

    def tflops(ms):
        return f"{flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s"

    group = NUM_HEADS // NUM_KV_HEADS
    q4 = q.view(batch, seq, NUM_HEADS, HEAD_SIZE).transpose(1, 2)
    k4 = k.view(batch, seq, NUM_KV_HEADS, HEAD_SIZE).transpose(1, 2).repeat_interleave(group, 1)
    v4 = v.view(batch, seq, NUM_KV_HEADS, HEAD_SIZE).transpose(1, 2).repeat_interleave(group, 1)
    anchors = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
        try:
            anchors[name] = do_bench(sdpa, warmup=50, rep=200, return_mode="median")
        except RuntimeError as error:  # a backend PyTorch cannot run here: report, go on
            print(f"SDPA {name} unavailable: {error}")
    best = min(anchors.values()) if anchors else float("nan")
    plain = do_bench(lambda: triton_kernels.varlen_attention(q, k, v, cu, cu), warmup=50, rep=200,
                     return_mode="median")
    diff = do_bench(lambda: triton_kernels.varlen_attention(q, k, v, cu, cu, lam), warmup=50,
                    rep=200, return_mode="median")
    blocks = batch * seq // BLOCK_SIZE  # the same keys, from a paged cache
    key_cache = k.view(blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    value_cache = v.view(blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    table = torch.arange(blocks, dtype=torch.int32, device="cuda").view(batch, -1)
    seq_lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    paged = do_bench(lambda: triton_kernels.paged_attention(q, key_cache, value_cache, cu,
                                                            seq_lens, table),
                     warmup=50, rep=200, return_mode="median")
    rows = [(f"prefill B={batch} S={seq} SDPA {name}", ms, tflops(ms), "anchor")
            for name, ms in anchors.items()]
    rows.append((f"prefill B={batch} S={seq} ours plain", plain, tflops(plain),
                 f"{best / plain:.2f} x best SDPA speed"))
    rows.append((f"prefill B={batch} S={seq} ours paged (block {BLOCK_SIZE})", paged,
                 tflops(paged), f"{best / paged:.2f} x best SDPA speed"))
    rows.append((f"prefill B={batch} S={seq} ours differential", diff, tflops(diff),
                 f"{diff / plain:.2f} x plain time (1.5 x the FLOPs)"))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    out = parser.parse_args().out
    bandwidth = copy_bandwidth()
    rows = [("copy (read + write)", float("nan"), f"{bandwidth / 1e12:.2f} TB/s", "anchor")]
    rows += decode_rows(bandwidth)
    rows += prefill_rows()
    header = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
              f"{triton.__version__}, {datetime.date.today()}; Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} "
              f"D={HEAD_SIZE} block={BLOCK_SIZE} {DTYPE}")
    lines = [header, "", "| case | ms | rate | ratio |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {ms:.4f} | {rate} | {ratio} |" for name, ms, rate, ratio in rows]
    table = "\n".join(lines)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
