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


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in the tensor-parallel group.

    Attributes:
        rank: this process's index in the group, ``0 <= rank < world_size``.
        world_size: ranks in the group (1: no parallelism, no collectives).
        group_name: the ``ProcessGroup.group_name`` the functional collectives run on (a
            string, so compiled graphs hold a constant, not a Python object).
    """

    rank: int = 0
    world_size: int = 1
    group_name: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.world_size, int) and self.world_size >= 1
                and isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ValueError(f"need 0 <= rank < world_size and world_size >= 1, got rank={self.rank!r}, "
                             f"world_size={self.world_size!r}")


_TP = TensorParallel()
_CPU_GROUPS: dict[str, dist.ProcessGroup] = {}  # group name -> its gloo twin


def init_tensor_parallel(world_size: int | None = None, rank: int | None = None, backend: str | None = None,
                         init_method: str | None = None) -> TensorParallel:
    """Join (or start) the default process group and make it this process's TP group.

    Args:
        world_size, rank: explicit values, or ``None`` to read torchrun's ``WORLD_SIZE`` /
            ``RANK`` environment (default 1 and 0: a single process).
        backend: ``"nccl"`` / ``"gloo"``; default NCCL when CUDA is available, else gloo.
        init_method: as :func:`torch.distributed.init_process_group` (default ``env://``,
            which needs ``MASTER_ADDR`` / ``MASTER_PORT``, set by torchrun).

    With CUDA, the current device becomes ``LOCAL_RANK`` (default ``rank``). A world of one
    initializes nothing. Returns the :class:`TensorParallel`, also kept for :func:`get_tp`.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``, or a process group already
            initialized with another size.
    """
    global _TP
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    TensorParallel(rank, world_size)  # validates
    if world_size == 1:
        _TP = TensorParallel()
        return _TP
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank)
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(f"the process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
                         f"asked for rank {rank} of {world_size}")
    _TP = TensorParallel(rank, world_size, dist.group.WORLD.group_name)
    # Host objects (broadcast_object) travel over a gloo twin of the group: over NCCL they would
    # be staged through the GPU and wait for its stream (vLLM's "cpu_group"). Its timeout is
    # unbounded in practice: a tensor-parallel worker waits there for rank 0's next step,
    # however long rank 0 stays idle.
    _CPU_GROUPS[_TP.group_name] = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    return _TP


def get_tp() -> TensorParallel:
    """This process's :class:`TensorParallel` (rank 0 of 1 before :func:`init_tensor_parallel`)."""
    return _TP


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_world_size() -> int:
    return _TP.world_size


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum of ``x`` over the group's ranks (a new tensor, same shape); ``x`` itself when
    ``world_size == 1``."""
    if tp.world_size == 1:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", tp.group_name))


def all_gather(x: torch.Tensor, tp: TensorParallel, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order (``[..., n, ...]`` ->
    ``[..., world_size * n, ...]``); ``x`` itself when ``world_size == 1``."""
    if tp.world_size == 1:
        return x
    # Gathered along dim 0 (rank order), then concatenated here: for any other dim funcol does
    # that through torch._utils._maybe_view_chunk_cat, which Dynamo of torch 2.11 refuses to trace
    # (a graph break under fullgraph; seen on the H200 pair, 2026-11-30). A flatten of moved dims
    # instead makes Dynamo guard the row count (a recompile per batch size).
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), 0, tp.group_name))
    # [world * rows, ...] -> [world, rows, ...] -> [..., world * n, ...]
    return torch.cat(gathered.view(tp.world_size, *x.shape).unbind(0), dim=dim)


def _cpu_group(tp: TensorParallel) -> dist.ProcessGroup:
    if tp.group_name not in _CPU_GROUPS:
        raise RuntimeError(f"no gloo twin of process group {tp.group_name!r}: make the group with "
                           "init_tensor_parallel")
    return _CPU_GROUPS[tp.group_name]


def same_on_every_rank(obj, tp: TensorParallel) -> bool:
    """Whether every rank's ``obj`` equals rank 0's (a broadcast and a gloo all-reduce; the
    same answer on every rank)."""
    if tp.world_size == 1:
        return True
    same = torch.tensor([int(broadcast_object(obj, tp) == obj)])
    dist.all_reduce(same, op=dist.ReduceOp.MIN, group=_cpu_group(tp))
    return bool(same.item())


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
        dist.destroy_process_group()
    _CPU_GROUPS.clear()
    _TP = TensorParallel()
