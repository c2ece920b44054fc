"""Bad input fails fast, through the public wrappers (eager), with a TypeError/ValueError
naming the argument, before any kernel runs.

A tripwire (a ``TorchDispatchMode``) fails these tests when any ``compiled_attn`` op is
dispatched, so a check that ran too late, or not at all, shows up as "kernel ran" instead of
the expected error; the checks themselves may run ordinary torch ops. Each case starts from
a valid call (checked to succeed by ``test_valid_*``) and breaks exactly one thing. Mixed
devices cannot be built on a CPU-only machine and are not tested here.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import compiled_attn  # noqa: F401
from compiled_attn.ops import (
    copy_blocks,
    paged_attention,
    reshape_and_cache,
    swap_blocks,
    varlen_attention,
)

from paged_batches import alibi_slopes, make_lambda, make_paged_batch, make_varlen_batch, randn_nonzero


class KernelRan(AssertionError):
    pass


class Tripwire(TorchDispatchMode):
    """Records and stops every ``compiled_attn`` op that reaches dispatch."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "compiled_attn":
            self.calls.append(func._schema.name.split("::")[1])
            raise KernelRan(f"op {func} ran before the argument check failed")
        return func(*args, **(kwargs or {}))


@pytest.fixture
def tripwire():
    with Tripwire() as mode:
        yield mode.calls


# --- valid baselines ----------------------------------------------------------------------


def _paged(num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32):
    b = make_paged_batch([(0, 5), (20, 2), (9, 1)], block_size=16, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype, seed=7)
    return dict(query=b.query, key_cache=b.key_cache, value_cache=b.value_cache,
                cu_seqlens_q=b.cu_seqlens_q, seq_lens=b.seq_lens, block_table=b.block_table)


def _varlen(num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32):
    b = make_varlen_batch([5, 2, 1], [5, 22, 10], num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_size=head_size, dtype=dtype, seed=8)
    return dict(q=b.q, k=b.k, v=b.v, cu_seqlens_q=b.cu_seqlens_q, cu_seqlens_k=b.cu_seqlens_k)


def _cache_write():
    g = torch.Generator().manual_seed(9)
    return dict(
        key=randn_nonzero((4, 2, 16), torch.float32, g),
        value=randn_nonzero((4, 2, 16), torch.float32, g),
        key_cache=randn_nonzero((3, 16, 2, 16), torch.float32, g),
        value_cache=randn_nonzero((3, 16, 2, 16), torch.float32, g),
        slot_mapping=torch.tensor([0, 17, -1, 47], dtype=torch.int64),
    )


def test_valid_calls_reach_the_kernel(tripwire):
    """Positive control: the unbroken baselines pass validation and reach the kernel."""
    with pytest.raises(KernelRan):
        paged_attention(**_paged())
    with pytest.raises(KernelRan):
        paged_attention(**_paged(), lambda_full=torch.tensor(0.5))
    with pytest.raises(KernelRan):
        varlen_attention(**_varlen())
    with pytest.raises(KernelRan):
        reshape_and_cache(**_cache_write())
    assert tripwire == ["paged_attention", "paged_attention", "varlen_attention", "reshape_and_cache"]


def test_valid_calls_without_tripwire():
    out = paged_attention(**_paged(), alibi_slopes=alibi_slopes(4), window_size=(4, -1), softcap=1.0)
    assert out.shape == (8, 4, 16) and bool(torch.isfinite(out).all())
    out = varlen_attention(**_varlen(), lambda_full=make_lambda(4, per_pair=True))
    assert out.shape == (8, 2, 32) and bool(torch.isfinite(out).all())


def test_block_table_padding_columns_are_not_validated():
    """Only the columns a sequence uses are block ids; padding columns may hold anything
    (e.g. -1), as a captured graph's padded block_table does."""
    args = _paged()
    expected = paged_attention(**args)
    table = args["block_table"].clone()
    table[0, 1:] = -1          # sequence 0 (5 keys) uses one block
    table[2, 1:] = 10_000      # sequence 2 (10 keys) uses one block
    args["block_table"] = table
    assert torch.equal(paged_attention(**args), expected)


# --- paged attention ------------------------------------------------------------------------


def _replace(base, **changes):
    args = dict(base)
    args.update(changes)
    return args


def _bad_paged_cases():
    """(id, kwargs changes as a function of the valid args, extra kwargs, exception, match)."""
    cases = [
        ("block_table_int64", lambda a: {"block_table": a["block_table"].long()}, {}, TypeError, "block_table"),
        ("block_table_float", lambda a: {"block_table": a["block_table"].float()}, {}, TypeError, "block_table"),
        ("seq_lens_int64", lambda a: {"seq_lens": a["seq_lens"].long()}, {}, TypeError, "seq_lens"),
        ("cu_seqlens_q_int64", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"].long()}, {}, TypeError, "cu_seqlens_q"),
        ("query_int", lambda a: {"query": a["query"].to(torch.int32)}, {}, TypeError, "query"),
        ("query_fp64", lambda a: {"query": a["query"].double()}, {}, TypeError, "query"),
        ("cache_dtype_differs", lambda a: {"key_cache": a["key_cache"].half(), "value_cache": a["value_cache"].half()},
         {}, TypeError, "key_cache"),
        ("value_cache_shape", lambda a: {"value_cache": a["value_cache"][:-1]}, {}, ValueError, "value_cache"),
        ("query_2d", lambda a: {"query": a["query"][:, 0]}, {}, ValueError, "query"),
        ("key_cache_3d", lambda a: {"key_cache": a["key_cache"][0], "value_cache": a["value_cache"][0]},
         {}, ValueError, "key_cache"),
        ("head_size_mismatch", lambda a: {"key_cache": a["key_cache"][..., :8], "value_cache": a["value_cache"][..., :8]},
         {}, ValueError, "head_size"),
        ("block_id_too_large", lambda a: {"block_table": _set(a["block_table"], (1, 1), a["key_cache"].shape[0])},
         {}, ValueError, "block_table"),
        ("block_id_negative", lambda a: {"block_table": _set(a["block_table"], (0, 0), -1)}, {}, ValueError, "block_table"),
        ("seq_len_beyond_block_table", lambda a: {"seq_lens": _set(a["seq_lens"], (2,), 16 * a["block_table"].shape[1] + 1)},
         {}, ValueError, "seq_lens"),
        ("seq_len_negative", lambda a: {"seq_lens": _set(a["seq_lens"], (1,), -3)}, {}, ValueError, "seq_lens"),
        ("cu_seqlens_q_not_from_zero", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"] + 1}, {}, ValueError, "cu_seqlens_q"),
        ("cu_seqlens_q_decreasing", lambda a: {"cu_seqlens_q": torch.tensor([0, 6, 5, 8], dtype=torch.int32)},
         {}, ValueError, "cu_seqlens_q"),
        ("cu_seqlens_q_end_not_num_tokens", lambda a: {"cu_seqlens_q": torch.tensor([0, 5, 7, 7], dtype=torch.int32)},
         {}, ValueError, "cu_seqlens_q"),
        ("cu_seqlens_q_wrong_length", lambda a: {"cu_seqlens_q": torch.tensor([0, 5, 8], dtype=torch.int32)},
         {}, ValueError, "cu_seqlens_q"),
        ("block_table_wrong_rows", lambda a: {"block_table": a["block_table"][:2]}, {}, ValueError, "block_table"),
        ("alibi_wrong_shape", lambda a: {}, {"alibi_slopes": alibi_slopes(2)}, ValueError, "alibi_slopes"),
        ("alibi_wrong_dtype", lambda a: {}, {"alibi_slopes": alibi_slopes(4).half()}, TypeError, "alibi_slopes"),
        ("window_below_minus_one", lambda a: {}, {"window_size": (-2, -1)}, ValueError, "window_size"),
        ("softcap_negative", lambda a: {}, {"softcap": -1.0}, ValueError, "softcap"),
        ("window_three_values", lambda a: {}, {"window_size": (1, 2, 3)}, TypeError, "window_size"),
        ("window_float", lambda a: {}, {"window_size": (2.5, -1)}, TypeError, "window_size"),
        ("scale_string", lambda a: {}, {"scale": "x"}, TypeError, "scale"),
        ("scale_nan", lambda a: {}, {"scale": float("nan")}, ValueError, "scale"),
        ("scale_zero", lambda a: {}, {"scale": 0.0}, ValueError, "scale"),
        ("lambda_wrong_shape", lambda a: {}, {"lambda_full": torch.ones(3)}, ValueError, "lambda_full"),
        ("lambda_2d", lambda a: {}, {"lambda_full": torch.ones(1, 2)}, ValueError, "lambda_full"),
        ("lambda_int", lambda a: {}, {"lambda_full": torch.tensor(1)}, TypeError, "lambda_full"),
    ]
    return cases


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


BAD_PAGED = _bad_paged_cases()


@pytest.mark.parametrize("change,extra,exc,match", [c[1:] for c in BAD_PAGED], ids=[c[0] for c in BAD_PAGED])
def test_paged_bad_input(tripwire, change, extra, exc, match):
    base = _paged()
    with pytest.raises(exc, match=match):
        paged_attention(**_replace(base, **change(base)), **extra)
    assert tripwire == []


@pytest.mark.parametrize("heads,differential", [((6, 4), False), ((4, 3), False), ((6, 3), True), ((3, 1), True),
                                                 ((4, 0), False)],
                         ids=["6_over_4", "4_over_3", "diff_odd_kv", "diff_odd_q", "zero_kv_heads"])
def test_paged_head_counts(tripwire, heads, differential):
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(0)
    args = _paged()
    args["query"] = randn_nonzero((8, num_heads, 16), torch.float32, g)
    args["key_cache"] = randn_nonzero((4, 16, num_kv_heads, 16), torch.float32, g)
    args["value_cache"] = args["key_cache"].clone()
    lam = torch.tensor(0.5) if differential else None
    match = "even number" if differential else "num_heads"
    with pytest.raises(ValueError, match=match) as info:
        paged_attention(**args, lambda_full=lam)
    assert "num_heads" in str(info.value) and "num_kv_heads" in str(info.value)
    assert tripwire == []


@pytest.mark.parametrize("head_size", [0, 257, 264])
def test_paged_unsupported_head_size(tripwire, head_size):
    g = torch.Generator().manual_seed(0)
    args = _paged()
    args["query"] = randn_nonzero((8, 4, head_size), torch.float32, g)
    args["key_cache"] = randn_nonzero((4, 16, 2, head_size), torch.float32, g)
    args["value_cache"] = args["key_cache"].clone()
    message = f"query: head size {head_size} is not supported; allowed: any int from 1 to 256 (as flash-attn)"
    with pytest.raises(ValueError) as info:
        paged_attention(**args)
    assert str(info.value) == message
    assert tripwire == []


@pytest.mark.parametrize("head_size", [1, 3, 12, 72, 111, 256])
def test_any_head_size_from_1_to_256_is_accepted(head_size):
    """As flash-attn: not only multiples of 8 (the kernels pad internally)."""
    lam = torch.tensor(0.5)
    assert paged_attention(**_paged(head_size=head_size), lambda_full=lam).shape[-1] == 2 * head_size
    assert varlen_attention(**_varlen(head_size=head_size)).shape[-1] == head_size


# --- varlen attention ---------------------------------------------------------------------------

BAD_VARLEN = [
    ("cu_seqlens_k_int64", lambda a: {"cu_seqlens_k": a["cu_seqlens_k"].long()}, {}, TypeError, "cu_seqlens_k"),
    ("cu_seqlens_q_int64", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"].long()}, {}, TypeError, "cu_seqlens_q"),
    ("q_int", lambda a: {"q": a["q"].to(torch.int32)}, {}, TypeError, r"\bq\b"),
    ("k_dtype_differs", lambda a: {"k": a["k"].half()}, {}, TypeError, "dtype"),
    ("v_shape", lambda a: {"v": a["v"][:-1]}, {}, ValueError, r"\bv\b"),
    ("k_2d", lambda a: {"k": a["k"][:, 0], "v": a["v"][:, 0]}, {}, ValueError, r"\bk\b"),
    ("head_size_mismatch", lambda a: {"k": a["k"][..., :8], "v": a["v"][..., :8]}, {}, ValueError, "head_size"),
    ("cu_seqlens_q_end", lambda a: {"cu_seqlens_q": torch.tensor([0, 5, 7, 9], dtype=torch.int32)},
     {}, ValueError, "cu_seqlens_q"),
    ("cu_seqlens_k_end", lambda a: {"cu_seqlens_k": torch.tensor([0, 5, 27, 36], dtype=torch.int32)},
     {}, ValueError, "cu_seqlens_k"),
    ("cu_seqlens_k_decreasing", lambda a: {"cu_seqlens_k": torch.tensor([0, 30, 27, 37], dtype=torch.int32)},
     {}, ValueError, "cu_seqlens_k"),
    ("cu_seqlens_lengths_differ", lambda a: {"cu_seqlens_k": torch.tensor([0, 37], dtype=torch.int32)},
     {}, ValueError, "cu_seqlens_k"),
    ("alibi_wrong_shape", lambda a: {}, {"alibi_slopes": alibi_slopes(8)}, ValueError, "alibi_slopes"),
    ("lambda_wrong_shape", lambda a: {}, {"lambda_full": torch.ones(4)}, ValueError, "lambda_full"),
    ("window_below_minus_one", lambda a: {}, {"window_size": (3, -5)}, ValueError, "window_size"),
]


@pytest.mark.parametrize("change,extra,exc,match", [c[1:] for c in BAD_VARLEN], ids=[c[0] for c in BAD_VARLEN])
def test_varlen_bad_input(tripwire, change, extra, exc, match):
    base = _varlen()
    with pytest.raises(exc, match=match):
        varlen_attention(**_replace(base, **change(base)), **extra)
    assert tripwire == []


@pytest.mark.parametrize("heads,head_size,differential,match", [
    ((6, 4), 16, False, "num_heads"),
    ((6, 3), 16, True, "even number"),
    ((5, 1), 16, True, "even number"),
    ((4, 2), 0, False, "q: head size 0 is not supported"),
    ((4, 2), 257, True, "q: head size 257 is not supported"),
], ids=["not_divisible", "diff_odd_kv_heads", "diff_odd_q_heads", "head_size_0", "head_size_257"])
def test_varlen_heads_and_head_size(tripwire, heads, head_size, differential, match):
    b = make_varlen_batch([3, 2], [4, 2], num_heads=heads[0], num_kv_heads=heads[1],
                          head_size=head_size, seed=1)
    lam = torch.tensor(0.5) if differential else None
    with pytest.raises(ValueError, match=match):
        varlen_attention(*b.attention_args(), lam)
    assert tripwire == []


# --- reshape_and_cache ----------------------------------------------------------------------------

BAD_WRITE = [
    ("slot_mapping_int32", lambda a: {"slot_mapping": a["slot_mapping"].int()}, TypeError, "slot_mapping"),
    ("slot_mapping_float", lambda a: {"slot_mapping": a["slot_mapping"].float()}, TypeError, "slot_mapping"),
    ("slot_too_large", lambda a: {"slot_mapping": _set(a["slot_mapping"], (1,), 48)}, ValueError, "slot_mapping"),
    ("slot_below_pad", lambda a: {"slot_mapping": _set(a["slot_mapping"], (0,), -2)}, ValueError, "slot_mapping"),
    ("token_count_mismatch", lambda a: {"slot_mapping": a["slot_mapping"][:3]}, ValueError, "slot_mapping"),
    ("value_shape", lambda a: {"value": a["value"][:3]}, ValueError, "value"),
    ("key_dtype_vs_cache", lambda a: {"key": a["key"].half(), "value": a["value"].half()}, TypeError, "dtype"),
    ("key_heads_vs_cache", lambda a: {"key": a["key"][:, :1], "value": a["value"][:, :1]}, ValueError, "heads"),
    ("key_2d", lambda a: {"key": a["key"][:, 0], "value": a["value"][:, 0]}, ValueError, "key"),
    ("value_cache_shape", lambda a: {"value_cache": a["value_cache"][:2]}, ValueError, "value_cache"),
]


@pytest.mark.parametrize("change,exc,match", [c[1:] for c in BAD_WRITE], ids=[c[0] for c in BAD_WRITE])
def test_reshape_and_cache_bad_input(tripwire, change, exc, match):
    base = _cache_write()
    args = _replace(base, **change(base))
    before = (args["key_cache"].clone(), args["value_cache"].clone())
    with pytest.raises(exc, match=match):
        reshape_and_cache(**args)
    assert tripwire == []
    assert torch.equal(args["key_cache"], before[0]) and torch.equal(args["value_cache"], before[1])


# --- copy_blocks / swap_blocks --------------------------------------------------------------------


def test_copy_and_swap_bad_input(tripwire):
    g = torch.Generator().manual_seed(3)
    kc = [randn_nonzero((4, 16, 2, 16), torch.float32, g)]
    vc = [randn_nonzero((4, 16, 2, 16), torch.float32, g)]
    ok = torch.tensor([[0, 1]], dtype=torch.int64)
    with pytest.raises(TypeError, match="block_mapping"):
        copy_blocks(kc, vc, ok.int())
    with pytest.raises(ValueError, match="block_mapping"):
        copy_blocks(kc, vc, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="block_mapping"):
        copy_blocks(kc, vc, torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="block_mapping"):
        copy_blocks(kc, vc, torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="value_cache must match key_cache"):
        copy_blocks(kc, [vc[0][:3]], ok)
    with pytest.raises(ValueError, match="same number of blocks"):
        copy_blocks(kc + [kc[0][:3]], vc + [vc[0][:3]], ok)
    with pytest.raises(ValueError, match="key_caches"):
        copy_blocks(kc, vc + vc, ok)
    dst = randn_nonzero((2, 16, 2, 16), torch.float32, g)
    with pytest.raises(ValueError, match="block_mapping"):
        swap_blocks(kc[0], dst, torch.tensor([[3, 2]]))
    with pytest.raises(TypeError, match="block_mapping"):
        swap_blocks(kc[0], dst, torch.tensor([[3, 1]], dtype=torch.float32))
    with pytest.raises(TypeError, match="dtype"):
        swap_blocks(kc[0], dst.half(), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="destinations must be distinct"):
        swap_blocks(kc[0], dst, torch.tensor([[0, 1], [2, 1]]))
    with pytest.raises(ValueError, match=r"src must be 4-D \[num_blocks"):
        swap_blocks(kc[0].flatten(), dst.flatten(), torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match=r"src must have dtype in \(torch.float16"):
        swap_blocks(kc[0].long(), dst.long(), torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match="key_caches must be a list"):
        copy_blocks(kc[0], vc[0], ok)
    assert tripwire == []


# --- the fake implementations check shapes/dtypes at trace time -------------------------------------


def test_fake_impl_rejects_bad_dtype_at_trace_time():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _paged()
    args["block_table"] = args["block_table"].long()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in args.values()]
        with pytest.raises(TypeError, match="block_table"):
            torch.ops.compiled_attn.paged_attention.default(*fake, None, 0.25, True, -1, -1, 0.0, None, None)


@pytest.mark.parametrize("head_size", [8, 256])
def test_head_size_bounds_accepted(head_size):
    b = make_paged_batch([(3, 2), (0, 1)], block_size=16, num_heads=2, num_kv_heads=2,
                         head_size=head_size, seed=head_size)
    out = paged_attention(*b.attention_args(), torch.tensor(0.5))
    assert out.shape == (3, 1, 2 * head_size) and bool(torch.isfinite(out).all())


def test_padded_row_block_table_not_validated():
    """A padded row (seq_len 0) may carry any block ids; it reads none and returns zeros."""
    from paged_batches import pad

    b = make_paged_batch([(5, 2), pad(1)], block_size=16, num_heads=2, num_kv_heads=2,
                         head_size=16, seed=4)
    table = b.block_table.clone()
    table[1] = -1
    out = paged_attention(b.query, b.key_cache, b.value_cache, b.cu_seqlens_q, b.seq_lens, table)
    assert bool((out[2] == 0).all()) and bool(torch.isfinite(out).all())


# --- value checks: once per metadata version, and the switch that turns them off ---------------


def test_value_checks_rerun_after_an_in_place_change():
    """Unchanged metadata is checked once (the layers of one forward share it); an in-place
    write bumps its version counter and the next call checks again."""
    args = _paged()
    paged_attention(**args)
    paged_attention(**args)
    args["block_table"][0, 0] = 10_000  # sequence 0 reads block 0 of its row
    with pytest.raises(ValueError, match=r"block_table\[0\] holds block ids \[10000\]"):
        paged_attention(**args)
    args["block_table"][0, 0] = 0
    args["seq_lens"][1] = 1_000
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=1000 is out of range"):
        paged_attention(**args)


def test_value_checks_see_a_new_tensor_with_the_same_values_and_version():
    """A new tensor that happens to have the version of the last checked one is checked
    (the cache compares tensor identity, not addresses that the allocator reuses)."""
    args = _paged()
    paged_attention(**args)
    bad = args["block_table"].clone()
    bad[2, 0] = -5
    with pytest.raises(ValueError, match=r"block_table\[2\] holds block ids \[-5\]"):
        paged_attention(**{**args, "block_table": bad})


@pytest.mark.parametrize("setting", ["0", "false", "OFF", " no "])
def test_value_checks_switched_off_by_the_environment(monkeypatch, tripwire, setting):
    args = _paged()
    args["seq_lens"] = args["seq_lens"].clone()
    args["seq_lens"][0] = 10_000
    monkeypatch.setenv("COMPILED_ATTN_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(**args)
    monkeypatch.setenv("COMPILED_ATTN_CHECK_VALUES", setting)
    with pytest.raises(KernelRan):  # shape checks pass, value checks skipped: the op runs
        paged_attention(**args)
    assert tripwire == ["paged_attention"]


def test_a_sequence_without_queries_has_its_block_ids_checked_too():
    """Every kernel may read the keys of every sequence (the CPU kernel gathers them all):
    block ids of a sequence with keys but no queries are checked like any other."""
    args = _paged()
    args["cu_seqlens_q"] = torch.tensor([0, 0, 2, 8], dtype=torch.int32)  # sequence 0: no query
    args["block_table"] = args["block_table"].clone()
    args["block_table"][0, 0] = 99
    with pytest.raises(ValueError, match=r"block_table\[0\] holds block ids \[99\]"):
        paged_attention(**args)


@pytest.mark.parametrize("where", ["meta", "fake"])
def test_public_functions_run_on_tensors_without_values(where):
    """Meta tensors and FakeTensorMode (shape propagation, export) skip the value checks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    paged, varlen, write = _paged(), _varlen(), _cache_write()
    if where == "meta":
        convert, mode = (lambda t: t.to("meta")), None
    else:
        mode = FakeTensorMode()
        convert = mode.from_tensor
    paged, varlen, write = ({k: convert(t) for k, t in d.items()} for d in (paged, varlen, write))
    with mode if mode is not None else torch.no_grad():
        assert paged_attention(**paged).shape == (8, 4, 16)
        assert varlen_attention(**varlen, lambda_full=convert(torch.tensor(0.5))).shape == (8, 2, 32)
        reshape_and_cache(**write)


@pytest.mark.parametrize("causal", ["yes", None, 1])
def test_causal_must_be_a_bool(causal):
    with pytest.raises(TypeError, match="causal must be a bool"):
        paged_attention(**_paged(), causal=causal)
    with pytest.raises(TypeError, match="causal must be a bool"):
        varlen_attention(**_varlen(), causal=causal)


def test_a_tensor_scale_under_compile_names_the_argument_without_printing_values():
    args = _paged()
    f = torch.compile(lambda scale: paged_attention(**args, scale=scale), fullgraph=True)
    with pytest.raises(Exception, match=r"scale must be a float or None, got Tensor of shape \(\)"):
        f(torch.tensor(0.3))


def test_paged_attention_has_no_backward_and_says_so():
    args = _paged()
    query = args.pop("query").clone().requires_grad_()
    out = paged_attention(query, **args)
    with pytest.raises(NotImplementedError, match="varlen_attention"):
        out.sum().backward()
