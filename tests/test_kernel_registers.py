"""Registers of the paged decode kernels compiled for sm90 (``tests/compile_sm90.py decode``,
Triton's bundled ptxas; no GPU needed).

Decode is bound by KV bandwidth, which needs programs resident: 65536 registers a
multiprocessor hold 4 programs of 4 warps at 128 registers a thread, 3 at 168. A change that
looked harmless (the split strides left unspecialized) took the plain kernel from 128 to 164
registers under Triton 3.6 and cost 12% of its bandwidth on an H200
(``profiling/results/kernels.md``, 2026-12-01).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed: these tests compile Triton kernels")


def test_decode_kernels_keep_their_programs_resident_on_sm90():
    from compiled_attn.ops.triton_kernels.config import FP8_DECODE_REGISTERS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_sm90.py")
    done = subprocess.run([sys.executable, str(script), "decode"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = {(r["case"], r["kernel"]): r for r in json.loads(done.stdout.strip().splitlines()[-1])}
    assert len(report) == 6  # 3 cases x (attention, merge): every case takes the split path
    plain = report["decode plain bf16", "attention_kernel"]
    assert plain["registers"] <= 128 and plain["spill_stores"] == 0, plain
    differential = report["decode differential bf16", "attention_kernel"]
    assert differential["spill_stores"] == 0, differential
    assert report["decode plain fp8", "attention_kernel"]["registers"] <= FP8_DECODE_REGISTERS
