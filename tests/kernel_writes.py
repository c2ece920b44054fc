"""Which tensors Inductor thinks each of our kernels writes, printed as JSON.

Run as a script in a process without ``TRITON_INTERPRET`` (compiled Triton functions, no GPU
needed): every launcher runs on small CPU tensors with launches recorded instead of made,
then Inductor's mutation analysis of a traced kernel
(``torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors``, which builds the
kernel's TTIR for an sm90 target) names the arguments each launch writes. An argument wrongly
named there is copied around every launch in compiled code (and stops CUDA graphs), so
``test_traced_kernels.py`` checks that only the outputs are named.
"""

from __future__ import annotations

import json

import torch
import triton
from triton.backends.compiler import GPUTarget


class _Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def recorded_launches() -> list[tuple[str, object, dict]]:
    """``(case, kernel, arguments by name)`` of one launch per kernel and case."""
    from compiled_attn.ops import triton_kernels
    from compiled_attn.ops.triton_kernels import launch_utils
    from compiled_attn.ops.triton_kernels.linear_kernel import LinearTiles

    launches, case = [], [""]

    def record(self, key, grid, args, device_index, specialize):
        constexprs, _ = specialize()
        launches.append((case[0], self.kernel, {**dict(zip(self.kernel.arg_names, args)), **constexprs}))

    launch_utils.CachedLauncher.__call__ = record
    g = torch.Generator().manual_seed(0)
    bf16 = dict(dtype=torch.bfloat16)
    q, cache = torch.randn(3, 8, 64, generator=g).to(**bf16), torch.randn(9, 16, 2, 64, generator=g).to(**bf16)
    cu, lens = torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.tensor([40, 7, 100], dtype=torch.int32)
    table = torch.arange(9, dtype=torch.int32).view(3, 3)
    for name, lam, splits in (("paged", None, 1), ("paged differential split", torch.tensor(0.5), 4)):
        case[0] = name
        triton_kernels.paged_attention(q, cache, cache, cu, lens, table, lam, num_splits=splits)
    fp8, scale = cache.to(torch.float8_e4m3fn), torch.tensor(0.5)
    case[0] = "paged fp8 differential split"
    triton_kernels.paged_attention(q, fp8, fp8, cu, lens, table, torch.tensor(0.5), k_scale=scale, v_scale=scale,
                                   num_splits=4)
    case[0] = "varlen"
    triton_kernels.varlen_attention(q, q[:, :2], q[:, :2], cu, cu)
    from compiled_attn.ops.triton_kernels.prefill import HOPPER_TILES, PrefillTiles
    lam, sequential = torch.full((4,), 0.5), PrefillTiles(128, 64, 8, 3, sequential=True)
    # the sequential schedule reads back the first component from its output rows
    for name, lam, tiles in (("varlen prefill", None, HOPPER_TILES[(64, False)]),
                             ("varlen prefill differential", lam, HOPPER_TILES[(64, True)]),
                             ("varlen prefill differential sequential", lam, sequential)):
        case[0] = name
        triton_kernels.varlen_prefill(q, q[:, :2], q[:, :2], cu, cu, lam, tiles=tiles, use_tma=True)
    case[0] = "reshape_and_cache"
    triton_kernels.reshape_and_cache(q[:, :2], q[:, :2], cache, cache, torch.tensor([0, 5, -1]))
    case[0] = "reshape_and_cache fp8"
    triton_kernels.reshape_and_cache(q[:, :2], q[:, :2], fp8, fp8, torch.tensor([0, 5, -1]), scale, scale)
    cu_k = torch.tensor([0, 40, 47, 147], dtype=torch.int32)
    kv = torch.randn(147, 2, 64, generator=g).to(**bf16)
    case[0] = "varlen backward"
    triton_kernels.varlen_attention_backward(q, q, kv, kv, cu, cu_k, None, 0.125, True, -1, -1, 0.0, None, None)
    case[0] = "varlen backward differential"  # with softcap, ALiBi, a window and per-call scalars
    triton_kernels.varlen_attention_backward(q[:, :4].repeat(1, 1, 2), q, kv, kv, cu, cu_k, torch.full((4,), 0.5),
                                             0.125, False, 8, 8, 0.0, torch.rand(8), torch.tensor([0.125, 5.0]))
    x, w = torch.randn(2, 64, generator=g).to(**bf16), torch.randn(128, 64, generator=g).to(**bf16)
    case[0] = "fused_linear"
    triton_kernels.fused_linear(x, w, None, x[0], 1e-6, x.new_ones(2, 64), True,
                                tiles=LinearTiles(2, 4, 64, num_warps=2, num_stages=1))
    from compiled_attn.ops.triton_kernels.norm_act_kernel import rms_norm, silu_and_mul
    case[0] = "rms_norm"
    rms_norm(x, x[0], 1e-6)
    case[0] = "silu_and_mul"
    silu_and_mul(x, x[:, :32])
    return launches


def main() -> None:
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    launches = recorded_launches()
    triton.runtime.driver.set_active(_Sm90())
    report = []
    for case, kernel, kwargs in launches:
        accesses = identify_accessed_tensors(kernel, kwargs, {})
        report.append({"case": case, "kernel": kernel.fn.__name__,
                       "writes": sorted(dep.name for dep in accesses.read_writes.writes)})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
