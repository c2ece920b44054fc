"""Inductor's mutation analysis names only our kernels' outputs as written.

Under ``torch.compile`` our launchers are traced into ``wrap_triton`` calls
(:func:`compiled_attn.ops.library.register_traced_kernel`); functionalization then copies
every argument the analysis counts as written, and CUDA-graph trees skip a graph whose input
is written. A pointer passed to a called ``@triton.jit`` helper whose result reaches a store
address counted as written (``cu_seqlens_q`` once did, via the sequence search). The analysis
runs in a subprocess without ``TRITON_INTERPRET`` (``tests/kernel_writes.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed")

EXPECTED = {
    ("paged", "attention_kernel"): ["out_ptr"],
    ("paged differential split", "attention_kernel"): ["lse_ptr", "out_ptr"],
    ("paged differential split", "merge_splits_kernel"): ["out_ptr"],
    ("paged fp8 differential split", "attention_kernel"): ["lse_ptr", "out_ptr"],
    ("paged fp8 differential split", "merge_splits_kernel"): ["out_ptr"],
    ("varlen", "attention_kernel"): ["out_ptr"],
    ("varlen prefill", "prefill_kernel"): ["out_ptr"],
    ("varlen prefill differential", "prefill_kernel"): ["out_ptr"],
    ("varlen prefill differential sequential", "prefill_kernel"): ["out_ptr"],
    ("reshape_and_cache", "reshape_and_cache_kernel"): ["key_cache_ptr", "value_cache_ptr"],
    ("reshape_and_cache fp8", "reshape_and_cache_kernel"): ["key_cache_ptr", "value_cache_ptr"],
    ("varlen backward", "attention_backward_dq_kernel"): ["delta_ptr", "dq_ptr", "lse_ptr"],
    ("varlen backward", "attention_backward_dkdv_kernel"): ["dk_ptr", "dv_ptr"],
    ("varlen backward differential", "attention_backward_dq_kernel"): ["delta_ptr", "dq_ptr", "lse_ptr"],
    ("varlen backward differential", "attention_backward_dkdv_kernel"): ["dk_ptr", "dv_ptr"],
    ("fused_linear", "fused_linear_kernel"): ["out_ptr"],
    ("rms_norm", "rms_norm_kernel"): ["out_ptr"],
    ("silu_and_mul", "silu_and_mul_kernel"): ["out_ptr"],
}


def test_each_kernel_writes_only_its_outputs():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("kernel_writes.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert {(r["case"], r["kernel"]): r["writes"] for r in report} == EXPECTED
