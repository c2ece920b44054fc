"""Tensor-parallel process group and the two collectives the sharded model needs.

Megatron-style tensor parallelism (Shoeybi et al., "Megatron-LM", arXiv 1909.08053 §3; vLLM's
``ColumnParallelLinear`` / ``RowParallelLinear``): each rank holds a column slice of the
projections that fan out (``qkv_proj``, ``gate_up_proj``, ``lm_head``) and a row slice of
those that fan in (``o_proj``, ``down_proj``), so one **all-reduce** per fan-in GEMM and one
**all-gather** of the logits make every rank's output equal the unsharded model's.

Built on ``torch.distributed`` (NCCL on GPUs, gloo on CPUs). The collectives are
``torch.distributed._functional_collectives``: they return new tensors instead of writing in
place, so ``torch.compile(fullgraph=True)`` traces them into the graph (no graph break) and a
CUDA graph captures them. A :class:`TensorParallel` with ``world_size == 1`` never calls them.

The all-reduce has a second kind on CUDA, ``"symm_mem"``, the default on one node whose
GPUs have peer access (``all_reduce="auto"``): a one-shot all-reduce
through torch's symmetric memory (``torch.distributed._symmetric_memory``; the idea of
vLLM's ``SymmMemCommunicator`` and of its custom all-reduce: every rank stages its input in
a buffer that the peers map over NVLink, then reads and sums all ranks' copies in one
kernel), for the small messages of a decode step, where NCCL's fixed cost dominates. See
:func:`init_tensor_parallel`.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .ops.library import define_op, register_kernel

ALL_REDUCE_KINDS = ("nccl", "symm_mem")
"""The all-reduce kinds a :class:`TensorParallel` holds; ``init_tensor_parallel`` also takes
``"auto"``, which picks one (see there)."""
SYMM_MEM_MAX_BYTES = 8 << 20  # the symmetric buffer; larger all-reduces take NCCL


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in the tensor-parallel group.

    Attributes:
        rank: this process's index in the group, ``0 <= rank < world_size``.
        world_size: ranks in the group (1: no parallelism, no collectives).
        group_name: the ``ProcessGroup.group_name`` the functional collectives run on (a
            string, so compiled graphs hold a constant, not a Python object).
        all_reduce: the all-reduce's kind, one of :data:`ALL_REDUCE_KINDS` (see
            :func:`init_tensor_parallel`).
    """

    rank: int = 0
    world_size: int = 1
    group_name: str = ""
    all_reduce: str = "nccl"

    def __post_init__(self) -> None:
        if self.all_reduce not in ALL_REDUCE_KINDS:
            raise ValueError(f"all_reduce must be one of {ALL_REDUCE_KINDS}, got {self.all_reduce!r}")
        if not (isinstance(self.world_size, int) and self.world_size >= 1
                and isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ValueError(f"need 0 <= rank < world_size and world_size >= 1, got rank={self.rank!r}, "
                             f"world_size={self.world_size!r}")


_TP = TensorParallel()
_CPU_GROUPS: dict[str, dist.ProcessGroup] = {}  # group name -> its gloo twin
_SYMM_MEM_BUFFERS: dict[str, torch.Tensor] = {}  # group name -> its rendezvoused staging buffer


def init_tensor_parallel(world_size: int | None = None, rank: int | None = None, backend: str | None = None,
                         init_method: str | None = None, all_reduce: str | None = None) -> TensorParallel:
    """Join (or start) the default process group and make it this process's TP group.

    Args:
        world_size, rank: explicit values, or ``None`` to read torchrun's ``WORLD_SIZE`` /
            ``RANK`` environment (default 1 and 0: a single process).
        backend: ``"nccl"`` / ``"gloo"``; default NCCL when CUDA is available, else gloo.
        init_method: as :func:`torch.distributed.init_process_group` (default ``env://``,
            which needs ``MASTER_ADDR`` / ``MASTER_PORT``, set by torchrun).
        all_reduce: ``"nccl"``: the process group's own functional all-reduce (NCCL, or gloo's
            on a gloo group: the CPU's only kind).
            ``"symm_mem"`` (NCCL backend only): a ``SYMM_MEM_MAX_BYTES`` symmetric buffer is
            allocated and rendezvoused here, and :func:`all_reduce` runs torch's
            ``symm_mem::one_shot_all_reduce_copy`` on it (see :func:`_symm_mem_all_reduce`):
            an 8 B model's TP=2 decode step on two H200s took 2.84 ms against 3.42 ms with
            NCCL at batch 1, 4.32 against 4.69 ms at batch 64 (``profiling/results/tp.md``).
            ``"auto"``: ``"symm_mem"`` with NCCL when every rank is on this node and each pair
            of its GPUs has peer access (as vLLM's custom all-reduce asks), else ``"nccl"``.
            ``None`` reads ``COMPILED_ATTN_ALL_REDUCE`` (default ``"auto"``).

    With CUDA, the current device becomes ``LOCAL_RANK`` (default ``rank``). A world of one
    initializes nothing. Returns the :class:`TensorParallel`, also kept for :func:`get_tp`.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``, a process group already
            initialized with another size, an unknown ``all_reduce`` (or
            ``COMPILED_ATTN_ALL_REDUCE``), ``"symm_mem"`` with a backend other than NCCL, or
            NCCL without CUDA.
    """
    global _TP
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    source = "all_reduce"
    if all_reduce is None:
        source, all_reduce = "COMPILED_ATTN_ALL_REDUCE", os.environ.get("COMPILED_ATTN_ALL_REDUCE", "auto")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if all_reduce not in ("auto", *ALL_REDUCE_KINDS):
        raise ValueError(f"{source} must be one of {('auto', *ALL_REDUCE_KINDS)}, got {all_reduce!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA GPUs, none is available here; use backend='gloo'")
    if all_reduce == "auto":
        all_reduce = "symm_mem" if backend == "nccl" and _peers_on_one_node(world_size) else "nccl"
    TensorParallel(rank, world_size, all_reduce=all_reduce)  # validates
    if all_reduce == "symm_mem" and backend != "nccl":
        raise ValueError(f"{source}='symm_mem' needs CUDA GPUs and the NCCL backend, got backend={backend!r}")
    if world_size == 1:
        _TP = TensorParallel(all_reduce=all_reduce)
        return _TP
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank)
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(f"the process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
                         f"asked for rank {rank} of {world_size}")
    _TP = TensorParallel(rank, world_size, dist.group.WORLD.group_name, all_reduce)
    if all_reduce == "symm_mem" and _TP.group_name not in _SYMM_MEM_BUFFERS:
        # Allocation and rendezvous are collective and block the host: never inside a capture.
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(SYMM_MEM_MAX_BYTES, dtype=torch.uint8,
                                device=torch.device("cuda", torch.cuda.current_device()))
        symm_mem.rendezvous(buffer, _TP.group_name)
        _SYMM_MEM_BUFFERS[_TP.group_name] = buffer
    # Host objects (broadcast_object) travel over a gloo twin of the group: over NCCL they would
    # be staged through the GPU and wait for its stream (vLLM's "cpu_group"). Its timeout is
    # unbounded in practice: a tensor-parallel worker waits there for rank 0's next step,
    # however long rank 0 stays idle.
    _CPU_GROUPS[_TP.group_name] = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    return _TP


def _peers_on_one_node(world_size: int) -> bool:
    """Every rank on this node (torchrun's ``LOCAL_WORLD_SIZE``) and GPUs ``0 ..
    world_size - 1`` peer-accessible in pairs."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) != world_size or torch.cuda.device_count() < world_size:
        return False
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(world_size) for b in range(world_size) if a != b)


def get_tp() -> TensorParallel:
    """This process's :class:`TensorParallel` (rank 0 of 1 before :func:`init_tensor_parallel`)."""
    return _TP


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_world_size() -> int:
    return _TP.world_size


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum of ``x`` over the group's ranks (a new tensor, same shape); ``x`` itself when
    ``world_size == 1``. The kind is ``tp.all_reduce`` (see :func:`init_tensor_parallel`)."""
    if tp.world_size == 1:
        return x
    if tp.all_reduce == "symm_mem":
        return symm_mem_all_reduce(x, tp.group_name)
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", tp.group_name))


def all_reduce_max(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Elementwise maximum of ``x`` over the group's ranks (a new tensor; eager, off the hot
    path: e.g. calibration); ``x`` itself when ``world_size == 1``."""
    if tp.world_size == 1:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "max", tp.group_name))


def _group_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The process group's own all-reduce of ``x`` (eager; what ``funcol.all_reduce`` traces to)."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "sum", group_name))


def _symm_mem_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """CUDA kernel of ``compiled_attn::symm_mem_all_reduce``: torch's one-shot all-reduce
    through the group's symmetric buffer (``init_tensor_parallel(all_reduce="symm_mem")``).

    ``symm_mem::one_shot_all_reduce_copy(buffer_view, x, "sum", group_name)`` is one kernel
    (torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu): it copies ``x`` into
    this rank's buffer, waits for every rank at a barrier on the buffer's signal pads, sums
    the ranks' buffers over peer-to-peer loads (NVLink, no multicast) into a new tensor and
    ends at a second barrier, so the next call may overwrite the buffer. Its launch depends
    on shapes only, so a CUDA graph captures it; every rank must run (or replay) the same
    all-reduces in the same order, as with NCCL.

    Limits of that kernel, which fall back to :func:`_group_all_reduce` (NCCL), decided from
    shapes and dtypes, the same on every rank: dtypes bfloat16 and float32 only; a size in
    bytes that is a multiple of 4 and at most the buffer's (``SYMM_MEM_MAX_BYTES``). A row
    of a decode step, ``[B, hidden]`` bfloat16, is ``2 * hidden`` bytes: 1024 rows of 4096.
    """
    buffer = _SYMM_MEM_BUFFERS[group_name]
    nbytes = x.numel() * x.element_size()
    if x.dtype not in (torch.bfloat16, torch.float32) or nbytes % 4 or nbytes > buffer.numel():
        return _group_all_reduce(x, group_name)
    x = x.contiguous()
    if x.storage_offset() * x.element_size() % 16:  # the kernel wants x aligned like the buffer
        x = x.clone()
    staged = buffer[:nbytes].view(x.dtype).view(x.shape)
    return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x, "sum", group_name)


# An op of its own, opaque to torch.compile: Dynamo and Inductor see a new tensor shaped like
# x (the fake), whatever the batch size, and never the symmetric buffer, which Inductor's own
# lowerings of the symm_mem ops would try to re-allocate as a buffer of theirs (possible at
# static sizes only: torch/_inductor/comm_lowering.py). On a device other than CUDA the op
# is the group's all-reduce.
symm_mem_all_reduce = define_op(
    "symm_mem_all_reduce(Tensor x, str group_name) -> Tensor", _group_all_reduce,
    lambda x, group_name: torch.empty_like(x, memory_format=torch.contiguous_format))
register_kernel(symm_mem_all_reduce, "CUDA", _symm_mem_all_reduce)


# torch 2.13 names it all_gather_single (all_gather_tensor, its old name, warns in eager code)
_ALL_GATHER = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)


def all_gather(x: torch.Tensor, tp: TensorParallel, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order (``[..., n, ...]`` ->
    ``[..., world_size * n, ...]``); ``x`` itself when ``world_size == 1``."""
    if tp.world_size == 1:
        return x
    # Gathered along dim 0 (rank order), then concatenated here: for any other dim funcol does
    # that through torch._utils._maybe_view_chunk_cat, which Dynamo of torch 2.11 refuses to trace
    # (a graph break under fullgraph; seen on the H200 pair, 2026-11-30). A flatten of moved dims
    # instead makes Dynamo guard the row count (a recompile per batch size).
    gathered = funcol.wait_tensor(_ALL_GATHER(x.contiguous(), 0, tp.group_name))
    # [world * rows, ...] -> [world, rows, ...] -> [..., world * n, ...]
    return torch.cat(gathered.view(tp.world_size, *x.shape).unbind(0), dim=dim)


def _cpu_group(tp: TensorParallel) -> dist.ProcessGroup:
    if tp.group_name not in _CPU_GROUPS:
        raise RuntimeError(f"no gloo twin of process group {tp.group_name!r}: make the group with "
                           "init_tensor_parallel")
    return _CPU_GROUPS[tp.group_name]


def all_ranks(flag: bool, tp: TensorParallel) -> bool:
    """Whether ``flag`` holds on every rank (a gloo all-reduce; the same answer on every rank)."""
    if tp.world_size == 1:
        return flag
    every = torch.tensor([int(flag)])
    dist.all_reduce(every, op=dist.ReduceOp.MIN, group=_cpu_group(tp))
    return bool(every.item())


def broadcast_object(obj, tp: TensorParallel):
    """Rank 0's ``obj`` (any picklable object, or ``None``) on every rank of ``tp``'s group,
    over gloo (host memory, no GPU stream waits); ``obj`` itself when ``world_size == 1``.
    Every rank calls it; the others' ``obj`` is ignored. ``None`` costs one 8-byte broadcast
    (its pickled size, 0), anything else a second one of its pickle (on 2 CPU cores: 0.23
    ms against 0.55 ms for ``broadcast_object_list``, which always sends two)."""
    if tp.world_size == 1:
        return obj
    group = _cpu_group(tp)
    data = pickle.dumps(obj) if tp.rank == 0 and obj is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    if not size.item():
        return None
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if tp.rank == 0 else \
        torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group)
    return obj if tp.rank == 0 else pickle.loads(payload.numpy().tobytes())


def destroy_tensor_parallel() -> None:
    """Leave the process group (if any) and reset :func:`get_tp` to a single process.

    Drop every engine first (``del engine``): NCCL's ``destroy_process_group`` waits forever
    while a CUDA graph that captured its collectives is alive (pytorch/pytorch#115388; seen on
    the H200 pair, 2026-11-30: the TP=2 CLI printed its tokens, then hung). Graphs left only
    in reference cycles are collected here before the group goes."""
    global _TP
    if dist.is_initialized():
        gc.collect()
        _SYMM_MEM_BUFFERS.clear()
        dist.destroy_process_group()
    _CPU_GROUPS.clear()
    _TP = TensorParallel()
