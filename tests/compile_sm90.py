"""Compile kernels for sm90 (H100/H200) without a GPU.

``python compile_sm90.py backward``: the backward kernels of ``varlen_attention``;
``python compile_sm90.py decode``: paged decode launches as an H200 (132 multiprocessors)
makes them, split into flash-decoding partials; ``python compile_sm90.py gluon``: the Gluon
prefill kernel (``gluon_prefill``), contiguous and paged. Run in a process without
``TRITON_INTERPRET``: the launcher runs on small CPU tensors with its launches recorded
instead of made (as ``kernel_writes.py``), then each recorded launch goes through
``triton.compile`` for a ``GPUTarget("cuda", 90, 32)`` (one forked process a core), every
stage down to the cubin (Triton's bundled ptxas), and ``ptxas -v`` of its PTX counts
registers and spills. Prints one JSON list of ``{case, kernel, shared, registers,
spill_stores, spill_loads, wgmma_serialized}`` (shared memory bytes, registers a thread);
a kernel that does not type-check or lower raises.
``test_attention_backward_kernel.py`` and ``test_kernel_registers.py`` run it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
import triton
from triton.backends import BaseBackend
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime import jit

TARGET = GPUTarget("cuda", 90, 32)


def record_launches(launches: list, case: list) -> None:
    """Patch :class:`CachedLauncher` so that launches append ``(case, kernel, arguments by
    name, options)`` to ``launches`` instead of running."""
    from compiled_attn.ops.triton_kernels import launch_utils

    def record(self, key, grid, args, device_index, specialize):
        constexprs, options = specialize()
        names = self.kernel.arg_names
        launches.append((case[0], self.kernel, {**dict(zip(names, args)), **constexprs}, options))

    launch_utils.CachedLauncher.__call__ = record


def decode_launches() -> list[tuple[str, object, dict, dict]]:
    """``(case, kernel, arguments by name, options)`` of paged decode at B=64, 4096 keys,
    Hq 32, Hkv 8, D 128, block 16 (2 flash-decoding splits on 132 multiprocessors): plain
    and differential over a bfloat16 cache, plain over a float8_e4m3fn cache."""
    from compiled_attn.ops.triton_kernels import attention

    launches, case = [], [""]
    record_launches(launches, case)
    g = torch.Generator().manual_seed(0)
    batch, context = 64, 4096
    blocks = batch * context // 16
    key = torch.randn(blocks, 16, 8, 128, generator=g).to(torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, 32, 128, generator=g).to(torch.bfloat16)
    scale = torch.tensor(0.5)
    fp8 = key.to(torch.float8_e4m3fn)
    with mock.patch.object(attention, "multiprocessor_count", lambda device: 132):
        for case[0], args, kwargs in (
                ("decode plain bf16", (query, key, key, cu, seq_lens, table), {}),
                ("decode differential bf16", (query, key, key, cu, seq_lens, table, torch.rand(16)), {}),
                ("decode plain fp8", (query, fp8, fp8, cu, seq_lens, table), dict(k_scale=scale, v_scale=scale))):
            attention.paged_attention(*args, **kwargs)
    return launches


def backward_launches() -> list[tuple[str, object, dict, dict]]:
    """``(case, kernel, arguments by name, options)`` of the backward launches of a few
    bfloat16 calls at their default tiles (plain GQA 4 D 128; differential D 64 with softcap,
    ALiBi, windows and per-call scalars; float32 D 72)."""
    from compiled_attn.ops.triton_kernels import attention_backward_kernel as backward

    launches, case = [], [""]
    record_launches(launches, case)
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 100, 356], dtype=torch.int32)
    for name, (heads, kv_heads, size, lam, dtype, extra) in {
        "plain gqa4 d128 bf16": (16, 4, 128, None, torch.bfloat16, {}),
        "differential d64 bf16 softcap alibi": (8, 4, 64, torch.full((4,), 0.5), torch.bfloat16,
                                                dict(causal=False, window_left=30, window_right=7,
                                                     alibi_slopes=torch.rand(8),
                                                     scale_softcap=torch.tensor([0.125, 5.0]))),
        "plain d72 fp32": (4, 4, 72, None, torch.float32, {}),
    }.items():
        case[0] = name
        q = torch.randn(356, heads, size, generator=g).to(dtype)
        kv = torch.randn(356, kv_heads, size, generator=g).to(dtype)
        grad = q if lam is None else torch.randn(356, heads // 2, 2 * size, generator=g).to(dtype)
        backward.varlen_attention_backward(grad, q, kv, kv, cu, cu, lam, size ** -0.5, **extra)
    return launches


def gluon_launches() -> list[tuple[str, object, dict, dict]]:
    """``(case, kernel, arguments by name, options)`` of the Gluon prefill kernel
    (``gluon_prefill``) at its tiles, bf16 causal, Hq 32, Hkv 8, on 132 multiprocessors:
    plain contiguous at D 64 and 128, paged at D 128 over blocks of 16, 64 and 256, and D 64
    over blocks of 16; differential contiguous at D 64 and 128 and paged at D 128 (block 16);
    the other ``early_waits`` of each default at D 128: plain contiguous without it (step
    waits), plain paged (block 16) and differential contiguous with it; plain contiguous without
    lazy rescaling (``lazy_rescale``: the plain defaults have it, and the differential one at D
    128)."""
    from compiled_attn.ops.triton_kernels import gluon_prefill
    from compiled_attn.ops.triton_kernels.gluon_prefill_kernel import gluon_prefill_kernel

    launches, case = [], [""]

    def record(grid, args, constexprs):
        launches.append((case[0], gluon_prefill_kernel, {**dict(zip(gluon_prefill_kernel.arg_names, args)),
                                                         **constexprs}, dict(num_warps=4)))

    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 100, 356], dtype=torch.int32)
    with mock.patch.object(gluon_prefill, "_run", record), \
            mock.patch.object(gluon_prefill, "_on_sm90", lambda tensor: True), \
            mock.patch.object(gluon_prefill, "multiprocessor_count", lambda device: 132):
        for head_size in (64, 128):
            case[0] = f"contiguous d{head_size}"
            q = torch.randn(356, 32, head_size, generator=g).to(torch.bfloat16)
            kv = torch.randn(356, 8, head_size, generator=g).to(torch.bfloat16)
            gluon_prefill.varlen_prefill(q, kv, kv, cu, cu)
        for head_size, block_size in ((128, 16), (128, 64), (128, 256), (64, 16)):
            case[0] = f"paged b{block_size} d{head_size}"
            q = torch.randn(356, 32, head_size, generator=g).to(torch.bfloat16)
            cache = torch.randn(4096 // block_size, block_size, 8, head_size, generator=g).to(torch.bfloat16)
            table = torch.arange(cache.shape[0], dtype=torch.int32).view(2, -1)
            gluon_prefill.paged_prefill(q, cache, cache, cu, torch.tensor([1124, 1380], dtype=torch.int32), table)
        lam = torch.full((16,), 0.5)
        for head_size in (64, 128):
            case[0] = f"differential contiguous d{head_size}"
            q = torch.randn(356, 32, head_size, generator=g).to(torch.bfloat16)
            kv = torch.randn(356, 8, head_size, generator=g).to(torch.bfloat16)
            gluon_prefill.varlen_prefill(q, kv, kv, cu, cu, lam)
        case[0] = "differential paged b16 d128"
        cache = torch.randn(256, 16, 8, 128, generator=g).to(torch.bfloat16)
        table = torch.arange(256, dtype=torch.int32).view(2, -1)
        gluon_prefill.paged_prefill(q, cache, cache, cu, torch.tensor([1124, 1380], dtype=torch.int32), table, lam)
        # the schedules the benchmark times beside the defaults (q and kv: D 128)
        step_waits = gluon_prefill.TILES._replace(early_waits=False)
        case[0] = "step-waits contiguous d128"
        gluon_prefill.varlen_prefill(q, kv, kv, cu, cu, tiles=step_waits)
        case[0] = "early-waits paged b16 d128"
        gluon_prefill.paged_prefill(q, cache, cache, cu, torch.tensor([1124, 1380], dtype=torch.int32), table,
                                    tiles=gluon_prefill.TILES)
        case[0] = "early-waits differential contiguous d128"
        gluon_prefill.varlen_prefill(q, kv, kv, cu, cu, lam,
                                     tiles=gluon_prefill.DIFFERENTIAL_TILES[128]._replace(early_waits=True))
        case[0] = "eager-rescale contiguous d128"
        gluon_prefill.varlen_prefill(q, kv, kv, cu, cu, tiles=gluon_prefill.TILES._replace(lazy_rescale=False))
    return launches


def compile_for_sm90(kernel, kwargs: dict, options: dict):
    """``triton.compile`` of one launch for :data:`TARGET` (specialized as ``JITFunction.run``
    would specialize it)."""
    backend = triton.compiler.compiler.make_backend(TARGET)
    signature, constants, attrs = {}, {}, {}
    for param in kernel.params:
        arg = kwargs[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constants[(param.num,)] = arg
            continue
        # an int equal to 1 specializes to a constant, as in a real launch (strides of 1 matter:
        # without them every load of a unit-stride dim compiles to one scalar load per element)
        kind, spec = jit.native_specialize_impl(BaseBackend, arg, param.is_const, not param.do_not_specialize,
                                                not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constants[(param.num,)] = arg
        elif isinstance(spec, str):
            attrs[(param.num,)] = backend.parse_attr(spec)
    source = GluonASTSource if kernel.is_gluon() else ASTSource
    return triton.compile(source(kernel, signature, constants, attrs), target=TARGET, options=options)


def ptxas_usage(ptx: str) -> dict:
    """Registers a thread, spill bytes and whether ptxas serialized the kernel's wgmma
    (``wgmma_serialized``) of the PTX's kernel (its ``maxnreg``, if any, is in the PTX), from
    the bundled ``ptxas -v`` for sm_90a."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(source),
                               "-o", str(Path(folder) / "kernel.cubin")], capture_output=True, text=True, check=True)
    log = done.stdout + done.stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    stores, loads = (int(x) for x in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    # ptxas C7515 and kin: every wgmma of the kernel issued synchronously
    serialized = "wgmma.mma_async instructions are serialized" in log
    return {"registers": registers, "spill_stores": stores, "spill_loads": loads, "wgmma_serialized": serialized}


_LAUNCHES: list = []  # what compile_launches' forked workers compile, by index


def _compile_one(index: int) -> dict:
    case, kernel, kwargs, options = _LAUNCHES[index]
    compiled = compile_for_sm90(kernel, kwargs, options)
    assert "cubin" in compiled.asm, f"{case}: no cubin"
    return {"shared": compiled.metadata.shared, **ptxas_usage(compiled.asm["ptx"])}


def compile_launches(launches: list) -> list[dict]:
    """``{shared, registers, spill_stores, spill_loads, wgmma_serialized}`` of each recorded
    launch (:func:`compile_for_sm90`, :func:`ptxas_usage`), in one forked process a core
    (the launches reach them by inheritance, not pickling); a failure raises here."""
    _LAUNCHES[:] = launches
    with multiprocessing.get_context("fork").Pool(min(len(launches), os.cpu_count() or 1)) as pool:
        return pool.map(_compile_one, range(len(launches)), chunksize=1)


def main() -> None:
    launches = {"backward": backward_launches, "decode": decode_launches, "gluon": gluon_launches}[sys.argv[1]]()
    report = [{"case": case, "kernel": kernel.fn.__name__, **usage}
              for (case, kernel, _, _), usage in zip(launches, compile_launches(launches))]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
