"""``fused_linear``: the Triton kernel (interpreter on the CPU, compiled on a GPU) and the op.

The oracle is an independent float64 computation (no intermediate rounding). The kernel
rounds where the unfused PyTorch code rounds, so its error is judged against that code's
own error in the same dtype: ``|kernel - oracle| <= 2 * |unfused - oracle|`` plus one unit
in the last place of the largest output (a single output can round the other way; 8 in
float32, where the summation order shows). Inputs
are fresh random values (never zeros); outputs are poisoned with NaN before each launch.
"""

from __future__ import annotations

import os

import pytest
import torch

from paged_batches import randn_nonzero

import compiled_attn.ops as ops
from compiled_attn.ops import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton = pytest.importorskip("triton", reason="Triton is not installed: these tests exercise Triton kernels")
from compiled_attn.ops import triton_kernels  # noqa: E402
from compiled_attn.ops.triton_kernels.linear_kernel import (  # noqa: E402
    GEMV_MAX_ROWS,
    LinearTiles,
    choose_linear_tiles,
)

needs_kernel = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)")
# bfloat16 tl.dot is wrong in Triton's interpreter (see test_triton_interpret.py).
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def oracle(x, weight, bias, norm_weight, eps, residual, silu_and_mul):
    x = x.double()
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    y = x @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    if silu_and_mul:
        gate, up = y.chunk(2, dim=-1)
        y = gate * torch.sigmoid(gate) * up
    return y if residual is None else y + residual.double()


def make_args(rows, out_features, in_features, dtype, *, bias=False, norm=False, residual=False,
              silu_and_mul=False, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    weight_rows = 2 * out_features if silu_and_mul else out_features
    args = dict(
        x=randn_nonzero((rows, in_features), dtype, g, scale=2.0),
        weight=randn_nonzero((weight_rows, in_features), dtype, g, scale=in_features ** -0.5),
        bias=randn_nonzero((weight_rows,), dtype, g, scale=0.5) if bias else None,
        norm_weight=(torch.rand(in_features, generator=g) + 0.5).to(dtype) if norm else None,
        norm_eps=1e-5,
        residual=randn_nonzero((rows, out_features), dtype, g) if residual else None,
        silu_and_mul=silu_and_mul,
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def assert_matches(out, args):
    positional = [args[k] for k in ("x", "weight", "bias", "norm_weight", "norm_eps", "residual", "silu_and_mul")]
    exact = oracle(*positional)
    unfused = reference.fused_linear(*positional).double()
    # float32 sums of K products in another order differ by ~sqrt(K) ulps: allow 8.
    ulps = 8 if args["x"].dtype == torch.float32 else 1
    ulp = ulps * torch.finfo(args["x"].dtype).eps * exact.abs().max().item()
    allowed = 2 * (unfused - exact).abs().max().item() + ulp
    assert out.shape == exact.shape and out.dtype == args["x"].dtype
    assert bool(torch.isfinite(out).all()), "unwritten (NaN) or non-finite outputs"
    error = (out.double() - exact).abs().max().item()
    assert error <= allowed, f"max error {error:.3g} > {allowed:.3g} (2x the unfused code's)"


def run_kernel(args, tiles=None, x=None):
    """The launcher with a NaN-poisoned ``out`` (the GEMV writes it; the cuBLAS path returns
    a new tensor)."""
    rows = args["x"].shape[0]
    out_features = args["weight"].shape[0] // (2 if args["silu_and_mul"] else 1)
    out = torch.full((rows, out_features), float("nan"), dtype=args["x"].dtype, device=args["x"].device)
    return triton_kernels.fused_linear(args["x"] if x is None else x, args["weight"], args["bias"],
                                       args["norm_weight"], args["norm_eps"], args["residual"],
                                       args["silu_and_mul"], tiles=tiles, out=out)


# Interpreter-sized cases: (rows, out, in, tiles (block_m, block_n, block_k) or None for the
# heuristic). Rows of 1, a partial row tile, several column tiles with a partial last one, K
# of whole and partial steps; above GEMV_MAX_ROWS rows the cuBLAS path (norm and SwiGLU kernels).
SHAPES = [
    (1, 40, 128, (1, 4, 64)),
    (5, 33, 200, (8, 4, 64)),
    (2, 16, 64, (2, 8, 32)),
    (8, 24, 96, (8, 2, 32)),
    (1, 40, 300, None),
    (3, 40, 300, None),
    (17, 48, 96, None),
    (64, 24, 72, None),
]
FEATURES = {
    "plain": {},
    "norm": dict(norm=True),
    "bias_residual": dict(bias=True, residual=True),
    "norm_silu_and_mul": dict(norm=True, silu_and_mul=True),
    "all": dict(norm=True, bias=True, silu_and_mul=True, residual=True),
}


@needs_kernel
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_matches_float64(dtype, shape, features):
    rows, out_features, in_features, tiles = shape
    args = make_args(rows, out_features, in_features, dtype, seed=rows + in_features, **FEATURES[features])
    tiles = tiles and LinearTiles(*tiles, num_warps=4, num_stages=1)
    assert_matches(run_kernel(args, tiles), args)


@needs_kernel
def test_kernel_reads_row_strides():
    """``x`` and ``residual`` as row-strided views (a slice of a wider buffer)."""
    args = make_args(3, 24, 64, torch.float32, norm=True, residual=True, seed=7)
    wide = torch.randn(3, 80, device=DEVICE)
    wide[:, 8:72] = args["x"]
    res_wide = torch.randn(3, 40, device=DEVICE)
    res_wide[:, 4:28] = args["residual"]
    args["residual"] = res_wide[:, 4:28]
    out = run_kernel(args, LinearTiles(4, 4, 32, 4, 1), x=wide[:, 8:72])
    assert_matches(out, args)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3])
def test_column_strided_residual(rows):
    """A column-strided residual: both launcher paths (GEMV, cuBLAS + SwiGLU kernel) read it
    right, and the op returns a contiguous tensor as its fake says (torch.compile)."""
    args = make_args(rows, 16, 32, torch.float32, norm=True, silu_and_mul=True, residual=True, seed=9)
    wide = torch.randn(rows, 32, device=DEVICE)
    wide[:, ::2] = args["residual"]
    args["residual"] = wide[:, ::2]  # column stride 2
    assert_matches(run_kernel(args), args)
    out = ops.fused_linear(args["x"], args["weight"], norm_weight=args["norm_weight"], residual=args["residual"],
                           silu_and_mul=True)
    assert out.is_contiguous()
    call = torch.compile(lambda x, r: ops.fused_linear(x, args["weight"], residual=r[:, :32]) * 2, fullgraph=True)
    x, r = args["x"], torch.randn(40, rows, device=DEVICE).t()
    torch.testing.assert_close(call(x, r), (x @ args["weight"].T + r[:, :32]) * 2, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_launcher_rejects_tiles_that_miss_rows():
    args = make_args(3, 16, 32, torch.float32, seed=2)
    with pytest.raises(ValueError, match="block_m"):
        run_kernel(args, LinearTiles(1, 4, 32, 2, 1))


@needs_kernel
def test_kernel_with_heuristic_tiles():
    args = make_args(2, 96, 300, torch.float32, norm=True, silu_and_mul=True, residual=True, seed=3)
    assert_matches(run_kernel(args), args)


def test_tile_heuristic_covers_the_rows():
    for rows in range(1, GEMV_MAX_ROWS + 1):
        tiles = choose_linear_tiles(rows, 3072, 2048, silu_and_mul=False)
        assert tiles.block_m >= rows and tiles.block_m & (tiles.block_m - 1) == 0


# --- the op ------------------------------------------------------------------------------


@pytest.mark.parametrize("features", list(FEATURES))
def test_op_matches_float64(features):
    """On the CPU the op is the reference; on a GPU the Triton GEMV (one row) or cuBLAS."""
    for rows in (1, 9, 65):
        args = make_args(rows, 40, 64, torch.float32, seed=rows, **FEATURES[features])
        out = ops.fused_linear(args["x"], args["weight"], args["bias"], norm_weight=args["norm_weight"],
                               norm_eps=args["norm_eps"], residual=args["residual"],
                               silu_and_mul=args["silu_and_mul"])
        assert_matches(out, args)


@pytest.mark.parametrize("features", list(FEATURES))
def test_gradients_match_finite_differences(features):
    """The op's autograd formula, in float64 (the reference kernel), every tensor input."""
    args = make_args(3, 6, 8, torch.float64, seed=5, device="cpu", **FEATURES[features])
    names = [k for k in ("x", "weight", "bias", "norm_weight", "residual") if args[k] is not None]
    leaves = [args[k].clone().requires_grad_() for k in names]

    def call(*tensors):
        kwargs = dict(args, **dict(zip(names, tensors)))
        return ops.fused_linear(kwargs["x"], kwargs["weight"], kwargs["bias"], norm_weight=kwargs["norm_weight"],
                                norm_eps=kwargs["norm_eps"], residual=kwargs["residual"],
                                silu_and_mul=kwargs["silu_and_mul"])

    assert torch.autograd.gradcheck(call, leaves)


def test_opcheck():
    for features in FEATURES.values():
        args = make_args(3, 16, 32, torch.float32, seed=1, **features)
        torch.library.opcheck(torch.ops.compiled_attn.fused_linear.default, tuple(args.values()))


@pytest.mark.parametrize("change, error, match", [
    (dict(x=torch.ones(2, 8, dtype=torch.int64)), TypeError, "x must have dtype"),
    (dict(x=torch.ones(2, 3, 8)), ValueError, "x must be 2-D"),
    (dict(weight=torch.ones(6, 7)), ValueError, r"weight must be \[out_features, 8\]"),
    (dict(weight=torch.ones(6, 8, dtype=torch.float16)), TypeError, "weight must have dtype"),
    (dict(bias=torch.ones(5)), ValueError, r"bias must be \[6\]"),
    (dict(norm_weight=torch.ones(7)), ValueError, r"norm_weight must be \[8\]"),
    (dict(norm_weight=torch.ones(8), norm_eps=0.0), ValueError, "norm_eps must be finite and > 0"),
    (dict(norm_eps=float("inf")), ValueError, "norm_eps must be finite and > 0"),
    (dict(norm_eps="1e-6"), TypeError, "norm_eps must be a float"),
    (dict(weight=None), TypeError, "weight must be a torch.Tensor"),
    (dict(residual=torch.ones(2, 5)), ValueError, r"residual must be \[2, 6\]"),
    (dict(weight=torch.ones(5, 8), silu_and_mul=True), ValueError, "even number of weight rows"),
    (dict(silu_and_mul=True, residual=torch.ones(2, 6)), ValueError, r"residual must be \[2, 3\]"),
])
def test_bad_arguments_raise(change, error, match):
    args = dict(x=torch.ones(2, 8), weight=torch.ones(6, 8), bias=None, norm_weight=None, norm_eps=1e-6,
                residual=None, silu_and_mul=False)
    args.update(change)
    x, weight = args.pop("x"), args.pop("weight")
    with pytest.raises(error, match=match):
        ops.fused_linear(x, weight, args.pop("bias"), **args)


# --- real sizes on the GPU ---------------------------------------------------------------

# The ~1.1B bench model's projections: qkv (norm), o (residual), gate_up (norm, SwiGLU),
# down (residual), lm_head (norm).
BENCH_SHAPES = {
    "qkv": (3072, 2048, dict(norm=True)),
    "o_proj": (2048, 2048, dict(residual=True)),
    "gate_up": (8192, 2048, dict(norm=True, silu_and_mul=True)),
    "down": (2048, 8192, dict(residual=True)),
    "lm_head": (32000, 2048, dict(norm=True)),
}


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (run on the H200: profiling/gpu_suite.sh)")
@pytest.mark.parametrize("name", list(BENCH_SHAPES))
def test_bench_shapes_on_gpu(name):
    out_features, in_features, features = BENCH_SHAPES[name]
    for rows in (1, 3, 8, 9, 40, 64):
        args = make_args(rows, out_features, in_features, torch.bfloat16, seed=rows, **features)
        assert_matches(run_kernel(args), args)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU (run on the H200: profiling/gpu_suite.sh)")
def test_op_in_cuda_graph_reads_new_inputs():
    """Captured once, replayed after the inputs changed in place: the new values are used."""
    args = make_args(4, 3072, 2048, torch.bfloat16, norm=True, residual=True, seed=1)
    call = lambda: ops.fused_linear(args["x"], args["weight"], norm_weight=args["norm_weight"],  # noqa: E731
                                    norm_eps=args["norm_eps"], residual=args["residual"])
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    fresh = make_args(4, 3072, 2048, torch.bfloat16, norm=True, residual=True, seed=2)
    args["x"].copy_(fresh["x"])
    args["residual"].copy_(fresh["residual"])
    graph.replay()
    fresh["weight"], fresh["norm_weight"] = args["weight"], args["norm_weight"]
    assert_matches(out, fresh)


def test_model_trains_through_fused_projections():
    """A loss over a DiffLlama's logits (no KV cache: the varlen op) reaches every parameter,
    and torch.compile(fullgraph=True) of forward + backward gives the eager gradients."""
    from compiled_attn.metadata import SequenceChunk, build_metadata
    from compiled_attn.models import DiffLlamaConfig
    from compiled_attn.models.diffllama import build_random_model

    config = DiffLlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=64, eos_token_id=None, lambda_std_dev=0.3)
    md = build_metadata([SequenceChunk([1, 5, 9, 2], 0, [0]), SequenceChunk([7, 3], 0, [1])], 16, 1)

    def loss(model):
        return model(md, None, all_logits=True).log_softmax(-1)[:, 0].sum()

    grads = []
    for compiled in (False, True):
        model = build_random_model(config, seed=4).requires_grad_(True)  # built for inference
        (torch.compile(loss, fullgraph=True) if compiled else loss)(model).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert grad is not None and bool(torch.isfinite(grad).all()) and grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
