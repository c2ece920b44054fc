"""Compile the backward kernels of ``varlen_attention`` for sm90 (H100/H200) without a GPU.

Run as a script in a process without ``TRITON_INTERPRET``: the launcher runs on small CPU
tensors with its launches recorded instead of made (as ``kernel_writes.py``), then each
recorded launch goes through ``triton.compile`` for a ``GPUTarget("cuda", 90, 32)``, every
stage down to the cubin (Triton's bundled ptxas). Prints one JSON list of
``{case, kernel, shared}`` (shared memory bytes); a kernel that does not type-check or lower
raises. ``test_attention_backward_kernel.py`` runs it.
"""

from __future__ import annotations

import json

import torch
import triton
from triton.backends import BaseBackend
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import jit

TARGET = GPUTarget("cuda", 90, 32)


def recorded_launches() -> list[tuple[str, object, dict, dict]]:
    """``(case, kernel, arguments by name, options)`` of the backward launches of a few
    bfloat16 calls at their default tiles (plain GQA 4 D 128; differential D 64 with softcap,
    ALiBi, windows and per-call scalars; float32 D 72)."""
    from compiled_attn.ops.triton_kernels import attention_backward_kernel as backward
    from compiled_attn.ops.triton_kernels import launch_utils

    launches, case = [], [""]

    def record(self, key, grid, args, device_index, specialize):
        constexprs, options = specialize()
        names = self.kernel.arg_names
        launches.append((case[0], self.kernel, {**dict(zip(names, args)), **constexprs}, options))

    launch_utils.CachedLauncher.__call__ = record
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
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=TARGET, options=options)


def main() -> None:
    report = []
    for case, kernel, kwargs, options in recorded_launches():
        compiled = compile_for_sm90(kernel, kwargs, options)
        assert "cubin" in compiled.asm, "no cubin"
        report.append({"case": case, "kernel": kernel.fn.__name__, "shared": compiled.metadata.shared})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
