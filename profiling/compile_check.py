"""Compile the Triton kernels for a GPU target on a machine without a GPU.

Runs the real launchers on small CPU tensors with each kernel replaced by a recorder, then
compiles every recorded launch with ``triton.compile`` for ``--arch`` (default sm_90, the
H100/H200) and prints registers, spills and shared memory per configuration. Catches what
the interpreter cannot (``tl.dot`` shape rules, layouts, resource limits) before any GPU
time is spent. Works with Triton 3.6 and 3.9 (``PYTHONPATH=/path/to/other/triton``).

    python profiling/compile_check.py [--arch 90]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this script compiles, it does not interpret")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from compiled_attn.ops import triton_kernels
from compiled_attn.ops.triton_kernels import attention, cache_kernel

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64"}


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


def source_of(fn, args, kwargs):
    """``ASTSource`` with Triton's default specialization (ints equal to 1 become
    constants, pointers and multiples of 16 get the divisibility hint)."""
    bound = dict(zip(fn.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    no_spec = set(getattr(fn, "do_not_specialize", ()) or ())
    no_spec = {fn.arg_names[i] if isinstance(i, int) else i for i in no_spec}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        value = bound[name]
        if fn.params[i].is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + DTYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1 and name not in no_spec:
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0 and name not in no_spec:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(value)}")
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return ASTSource(fn, signature, constexprs, attrs), options


def resource_usage(cubin: bytes) -> str:
    """``REG:.. STACK:.. LOCAL:..`` of a cubin, from the ``cuobjdump`` Triton ships."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", report)
    return f"regs={match[1]} stack={match[2]} local={match[3]}" if match else report.strip()


def cases():
    """(label, launcher call) over head sizes, dtypes, plain/differential, decode/prefill."""
    for head_size, dtype, differential, phase in itertools.product(
            (64, 128, 256), (torch.bfloat16, torch.float16, torch.float32), (False, True),
            ("decode", "prefill")):
        num_heads, num_kv_heads, block_size = 32, 8, 16
        num_seqs = 4
        q_len = 1 if phase == "decode" else 256
        query = torch.empty(num_seqs * q_len, num_heads, head_size, dtype=dtype)
        cache = torch.empty(64, block_size, num_kv_heads, head_size, dtype=dtype)
        cu = torch.arange(0, num_seqs + 1, dtype=torch.int32) * q_len
        lens = torch.full((num_seqs,), 64, dtype=torch.int32)
        table = torch.zeros(num_seqs, 16, dtype=torch.int32)
        lam = torch.tensor(0.5) if differential else None
        label = f"D={head_size} {DTYPES[dtype]} {'diff' if differential else 'plain'} {phase}"
        yield label, lambda: triton_kernels.paged_attention(
            query, cache, cache, cu, lens, table, lam, num_splits=4 if phase == "decode" else 1)
    key = torch.empty(8, 8, 128, dtype=torch.bfloat16)
    yield "reshape_and_cache", lambda: triton_kernels.reshape_and_cache(
        key, key, torch.empty(4, 16, 8, 128, dtype=torch.bfloat16),
        torch.empty(4, 16, 8, 128, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int64))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    target = GPUTarget("cuda", parser.parse_args().arch, 32)
    calls = []
    attention.attention_kernel = Recorder(attention.attention_kernel, calls)
    attention.merge_splits_kernel = Recorder(attention.merge_splits_kernel, calls)
    cache_kernel.reshape_and_cache_kernel = Recorder(cache_kernel.reshape_and_cache_kernel, calls)
    print(f"triton {triton.__version__}, target {target}")
    failures = 0
    for label, launch in cases():
        calls.clear()
        launch()
        for fn, args, kwargs in calls:
            src, options = source_of(fn, args, kwargs)
            try:
                kernel = triton.compile(src, target=target, options=options)
            except Exception as error:  # report every failing configuration, then fail
                failures += 1
                print(f"FAIL {label:34s} {fn.__name__}: {type(error).__name__}: {error}"[:2000])
                continue
            meta = kernel.metadata
            print(f"ok   {label:34s} {fn.__name__:26s} warps={meta.num_warps} stages={meta.num_stages} "
                  f"shared={meta.shared} {resource_usage(kernel.asm['cubin'])}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
