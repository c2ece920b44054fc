"""Case ``shared/cases/scale-argument-under-compile.md``: a float (or int) option passed per
call to a compiled function (softmax ``scale``, ``softcap``, ``window_size``) must give the
eager result for its own value, compile at most one more graph when it first changes (then
none), and never raise.

Dynamo compiles the first call with the value as a constant and, when it changes, once more
with it symbolic ("automatic dynamic"). A symbolic float that reaches an op's ``float``
argument, or a Python comparison, is specialized again on every value; the public functions
therefore hand traced floats to the op as the ``scale_softcap`` tensor and check float values
only eagerly.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import compiled_attn.ops as ops
from oracle import oracle_paged, oracle_varlen
from paged_batches import make_lambda, make_paged_batch

q = torch.randn(7, 4, 16, generator=torch.Generator().manual_seed(0))
k = torch.randn(7, 2, 16, generator=torch.Generator().manual_seed(1))
v = torch.randn(7, 2, 16, generator=torch.Generator().manual_seed(2))
cu = torch.tensor([0, 4, 7], dtype=torch.int32)


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def test_scale_argument_under_compile():
    """The reported script: scale 0.25 then 0.30 (and more), each equal to eager and to the
    float64 oracle, at most two graphs in all."""
    f = torch.compile(lambda q, k, v, s: ops.varlen_attention(q, k, v, cu, cu, scale=s), fullgraph=True)
    before = graphs_compiled()
    for scale in (0.25, 0.30, 0.45, 0.125):
        got = f(q, k, v, scale)
        torch.testing.assert_close(got, ops.varlen_attention(q, k, v, cu, cu, scale=scale))
        expected = oracle_varlen(q, k, v, cu, cu, scale=scale)
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert graphs_compiled() - before <= 2


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_per_call_softcap_compiles_at_most_one_more_graph(dynamic):
    lam = make_lambda(4, per_pair=True)
    f = torch.compile(lambda q, k, v, c: ops.varlen_attention(q, k, v, cu, cu, lam, softcap=c),
                      fullgraph=True, dynamic=dynamic)
    before = graphs_compiled()
    for softcap in (0.0, 2.0, 3.5, 0.0, 7.0):  # 0 turns capping off again
        got = f(q, k, v, softcap)
        torch.testing.assert_close(got, ops.varlen_attention(q, k, v, cu, cu, lam, softcap=softcap))
    assert graphs_compiled() - before <= 2


def test_per_call_scale_softcap_and_window_of_paged_attention():
    batch = make_paged_batch([(0, 5), (19, 2), (6, 1)], num_heads=4, num_kv_heads=2, head_size=16, seed=3)
    args = batch.attention_args()

    def attend(scale, softcap, left):
        return ops.paged_attention(*args, scale=scale, softcap=softcap, window_size=(left, -1))

    f = torch.compile(attend, fullgraph=True)
    before = graphs_compiled()
    for scale, softcap, left in ((0.25, 0.0, -1), (0.3, 1.5, 4), (0.2, 3.0, 7), (0.5, 0.0, 2)):
        got = f(scale, softcap, left)
        torch.testing.assert_close(got, attend(scale, softcap, left))
        expected = oracle_paged(*args, scale=scale, softcap=softcap, window=(left, -1))
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert graphs_compiled() - before <= 2


def test_bad_scale_still_raises_eagerly():
    with pytest.raises(ValueError, match="scale must be finite and > 0, got nan"):
        ops.varlen_attention(q, k, v, cu, cu, scale=float("nan"))
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        ops.varlen_attention(q, k, v, cu, cu, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap must be finite and >= 0"):
        ops.varlen_attention(q, k, v, cu, cu, softcap=float("inf"))
    with pytest.raises(TypeError, match="scale must be a float or None, got str"):
        ops.varlen_attention(q, k, v, cu, cu, scale="0.1")


def test_bad_traced_scale_or_softcap_raises_when_the_graph_runs():
    """A traced float is not compared in Python (that would specialize the graph), but its
    value is checked when the graph runs: no silent NaN."""
    f = torch.compile(lambda q, k, v, s, c: ops.varlen_attention(q, k, v, cu, cu, scale=s, softcap=c),
                      fullgraph=True)
    f(q, k, v, 0.25, 1.0)
    f(q, k, v, 0.3, 2.0)  # now symbolic
    for scale, softcap in ((float("nan"), 1.0), (-1.0, 1.0), (0.25, -1.0), (0.25, float("inf"))):
        with pytest.raises(RuntimeError, match="scale must be finite and > 0 and softcap finite and >= 0"):
            f(q, k, v, scale, softcap)


def _op_scalars(fn, *args) -> list:
    """The ``(scale, softcap, scale_softcap)`` arguments of each ``varlen_attention`` call in
    the graph Dynamo captures of ``fn(*args)`` (``scale_softcap``: ``None`` or ``"tensor"``)."""
    calls = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target is torch.ops.compiled_attn.varlen_attention.default:
                scale, softcap, scale_softcap = node.args[6], node.args[10], node.args[12]
                calls.append((scale, softcap, None if scale_softcap is None else "tensor"))
        return gm

    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return calls


def test_default_scale_and_softcap_reach_the_op_as_floats_under_compile():
    """Left at their defaults, scale and softcap are constants of the trace: the op gets
    floats (what the flash-attn backend needs), not the ``scale_softcap`` tensor."""
    assert _op_scalars(lambda q, k, v: ops.varlen_attention(q, k, v, cu, cu), q, k, v) == [(0.25, 0.0, None)]
    given = _op_scalars(lambda q, k, v: ops.varlen_attention(q, k, v, cu, cu, scale=0.25), q, k, v)
    assert given == [(1.0, 0.0, "tensor")]


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_default_scale_of_a_changing_head_size_under_compile(dynamic):
    """The head size changes between calls: Dynamo makes it symbolic, and with it the default
    scale ``head_size ** -0.5``, which must not reach a Python check while tracing."""
    lam = make_lambda(4, per_pair=True)
    varlen = torch.compile(lambda q, k, v: ops.varlen_attention(q, k, v, cu, cu, lam), fullgraph=True,
                           dynamic=dynamic)
    g = torch.Generator().manual_seed(4)
    for head_size in (16, 32, 72):
        qh, kh, vh = (torch.randn(7, heads, head_size, generator=g) for heads in (4, 2, 2))
        torch.testing.assert_close(varlen(qh, kh, vh), ops.varlen_attention(qh, kh, vh, cu, cu, lam))
        batch = make_paged_batch([(0, 5), (19, 2)], num_heads=4, num_kv_heads=2, head_size=head_size, seed=head_size)
        paged = torch.compile(lambda *args: ops.paged_attention(*args), fullgraph=True, dynamic=dynamic)
        torch.testing.assert_close(paged(*batch.attention_args()), ops.paged_attention(*batch.attention_args()))
