"""The all-reduce's kinds (``compiled_attn.distributed``): clear errors for an unknown kind and
for ``symm_mem`` without NCCL; the ``symm_mem`` op traced by ``torch.compile(fullgraph=True)``
with a dynamic batch and no recompile (on the CPU the op runs the group's all-reduce, gloo);
and, on two GPUs, the symmetric-memory all-reduce equal to NCCL's, eager, compiled and
replayed from CUDA graphs, including the shapes and dtypes that fall back to NCCL."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from compiled_attn import distributed
from compiled_attn.compile import CompiledFunction
from compiled_attn.distributed import (SYMM_MEM_MAX_BYTES, TensorParallel, all_reduce, destroy_tensor_parallel,
                                       init_tensor_parallel)

WORLD = 2
HIDDEN = 4096


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(rank: int, shape, dtype, device, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, so any order of summing them is exact."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-32, 33, shape, generator=generator).to(dtype=dtype, device=device)


def _expected(shape, dtype, device, seed: int = 0) -> torch.Tensor:
    return sum(_data(r, shape, dtype, device, seed) for r in range(WORLD))


def test_unknown_kind_raises(monkeypatch):
    with pytest.raises(ValueError, match=r"all_reduce must be one of \('nccl', 'symm_mem'\), got 'ring'"):
        TensorParallel(all_reduce="ring")
    with pytest.raises(ValueError, match="all_reduce must be one of"):
        init_tensor_parallel(1, 0, backend="gloo", all_reduce="ring")
    monkeypatch.setenv("COMPILED_ATTN_ALL_REDUCE", "ring")
    with pytest.raises(ValueError, match="COMPILED_ATTN_ALL_REDUCE must be one of .*got 'ring'"):
        init_tensor_parallel(1, 0, backend="gloo")


def test_symm_mem_needs_nccl(monkeypatch):
    with pytest.raises(ValueError, match=r"all_reduce='symm_mem' needs CUDA GPUs and the NCCL backend, "
                                         r"got backend='gloo'"):
        init_tensor_parallel(WORLD, 0, backend="gloo", all_reduce="symm_mem")
    monkeypatch.setenv("COMPILED_ATTN_ALL_REDUCE", "symm_mem")
    with pytest.raises(ValueError, match="COMPILED_ATTN_ALL_REDUCE='symm_mem' needs CUDA GPUs"):
        init_tensor_parallel(1, 0, backend="gloo")
    assert init_tensor_parallel(1, 0, backend="gloo", all_reduce="nccl").all_reduce == "nccl"
    assert init_tensor_parallel(1, 0, backend="gloo", all_reduce="auto").all_reduce == "nccl"  # gloo: no symm_mem
    monkeypatch.delenv("COMPILED_ATTN_ALL_REDUCE", raising=False)
    assert init_tensor_parallel(1, 0, backend="gloo").all_reduce == "nccl"


def _compiled_worker(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tp = init_tensor_parallel(WORLD, rank, backend="gloo")
    try:
        # init refuses symm_mem on gloo; made by hand, it runs the op's CPU kernel (gloo)
        symm = dataclasses.replace(tp, all_reduce="symm_mem")
        fn = CompiledFunction(lambda x: all_reduce(x * 2, symm) + 1)
        for rows in (1, 3, 8, 1):
            x = _data(rank, (rows, 16), torch.float32, "cpu")
            torch.testing.assert_close(fn(x), 2 * _expected((rows, 16), torch.float32, "cpu") + 1, rtol=0, atol=0)
        results[rank] = (fn.stats.graphs_compiled, fn.stats.graph_breaks, fn.stats.recompiles)
    finally:
        destroy_tensor_parallel()


def test_symm_mem_op_compiles_with_a_dynamic_batch():
    """One graph for every batch size: the op is opaque to Dynamo and Inductor (its fake is a
    new tensor shaped like the input)."""
    results = mp.Manager().dict()
    mp.spawn(_compiled_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    assert results[0] == results[1] == (1, 0, 0)


# (shape, dtype, storage offset in elements, falls back to NCCL)
GPU_CASES = [
    ((1, HIDDEN), torch.bfloat16, 0, False), ((3, HIDDEN), torch.bfloat16, 0, False),
    ((64, HIDDEN), torch.bfloat16, 0, False), ((5, HIDDEN), torch.float32, 0, False),
    ((2, 7), torch.bfloat16, 0, False), ((3, HIDDEN), torch.bfloat16, 1, False),
    ((1, 3), torch.bfloat16, 0, True),  # 6 bytes: not a multiple of 4
    ((2, HIDDEN), torch.float16, 0, True),  # not a dtype of the kernel
    ((SYMM_MEM_MAX_BYTES // (2 * HIDDEN) + 1, HIDDEN), torch.bfloat16, 0, True),  # over the buffer
]


def _gpu_worker(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (the machine's rule)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    tp = init_tensor_parallel(WORLD, rank, backend="nccl", all_reduce="symm_mem")
    nccl = dataclasses.replace(tp, all_reduce="nccl")
    failures, graphs = [], []

    def check(name, got, expected):
        if not torch.equal(got, expected):
            failures.append(f"{name}: max error {(got.float() - expected.float()).abs().max().item()}")

    fallbacks = []  # shapes that the symm_mem kernel handed to NCCL
    group_all_reduce = distributed._group_all_reduce
    distributed._group_all_reduce = lambda x, group_name: fallbacks.append(x.shape) or group_all_reduce(x, group_name)
    try:
        for shape, dtype, offset, falls_back in GPU_CASES:
            name = f"{shape} {dtype} offset {offset}"
            numel = torch.Size(shape).numel()
            flat = torch.zeros(offset + numel, dtype=dtype, device="cuda")
            x = flat[offset:].view(shape).copy_(_data(rank, shape, dtype, "cuda"))
            expected = _expected(shape, dtype, "cuda")
            check(f"eager symm_mem {name}", all_reduce(x, tp), expected)
            if bool(fallbacks) != falls_back:
                failures.append(f"{name}: fell back to NCCL: {bool(fallbacks)}, expected {falls_back}")
            fallbacks.clear()
            check(f"eager nccl {name}", all_reduce(x, nccl), expected)

        fn = CompiledFunction(lambda x: all_reduce(x * 2, tp) + 1)
        sizes = (64, 8, 1)
        for rows in sizes:  # compiled, eager (as the engine's warm-up before capture)
            shape = (rows, HIDDEN)
            check(f"compiled {shape}", fn(_data(rank, shape, torch.bfloat16, "cuda")),
                  2 * _expected(shape, torch.bfloat16, "cuda") + 1)
        stats = fn.stats
        if (stats.graph_breaks, stats.recompiles) != (0, 0) or fallbacks:
            failures.append(f"compiled: {stats}, fell back to NCCL for {fallbacks}")

        pool = None  # captured largest first into one pool, as the graph runner does
        for rows in sizes:
            static_x = _data(rank, (rows, HIDDEN), torch.bfloat16, "cuda")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                static_out = fn(static_x)
            pool = graph.pool()
            graphs.append((rows, graph, static_x, static_out))
        for seed in (1, 2, 3):
            for rows, graph, static_x, static_out in graphs:
                shape = (rows, HIDDEN)
                static_x.copy_(_data(rank, shape, torch.bfloat16, "cuda", seed))
                graph.replay()
                check(f"graph {shape} seed {seed}", static_out, 2 * _expected(shape, torch.bfloat16, "cuda", seed) + 1)
            x = _data(rank, (5, HIDDEN), torch.bfloat16, "cuda", seed)  # eager calls between replays
            expected = _expected((5, HIDDEN), torch.bfloat16, "cuda", seed)
            check(f"eager between replays seed {seed}", all_reduce(x, tp), expected)
        torch.cuda.synchronize()
        results[rank] = failures
    finally:
        graphs.clear()  # before the group goes (see destroy_tensor_parallel)
        destroy_tensor_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD,
                    reason="needs 2 CUDA GPUs: symmetric memory is mapped between the GPUs of one host")
def test_symm_mem_all_reduce_matches_nccl_on_two_gpus():
    """Inputs are small integers, so every sum is exact: the symmetric-memory all-reduce must
    equal NCCL's bit for bit, eager, compiled (one graph, no recompile) and replayed from
    CUDA graphs captured into one pool (with eager all-reduces between replays)."""
    results = mp.Manager().dict()
    mp.spawn(_gpu_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    assert results[0] == [] and results[1] == [], dict(results)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA GPUs"):
        init_tensor_parallel(2, 0, backend="nccl")
