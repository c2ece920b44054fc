"""``torch.compile`` with dynamic batch shapes, and compile accounting.

Batch size and token count change every step. To get one graph per static variant
(pure prefill vs. the rest) and no recompiles, dim 0 (tokens or sequences) of every
batch tensor is marked dynamic before each call, and tracing runs with
``torch.fx.experimental._config.backed_size_oblivious`` so that a first call with one
token or one sequence does not specialize the graph to size 1. The model forward and the
sampler are compiled this way and counted in one :class:`CompileStats`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch._dynamo.utils import counters
from torch.fx.experimental import _config as fx_config

from .metadata import TENSOR_FIELDS, AttentionMetadata


def mark_batch_dynamic(*args) -> None:
    """Mark dim 0 of every tensor argument, and of every metadata tensor, as dynamic."""
    for arg in args:
        if isinstance(arg, AttentionMetadata):
            for name in TENSOR_FIELDS:
                torch._dynamo.mark_dynamic(getattr(arg, name), 0)
        elif isinstance(arg, torch.Tensor):
            torch._dynamo.mark_dynamic(arg, 0)


def _variant(args) -> tuple:
    """The static part of a call: metadata's ``prefill_only`` and bool flags."""
    return tuple(a.prefill_only if isinstance(a, AttentionMetadata) else a
                 for a in args if isinstance(a, (AttentionMetadata, bool)))


def _graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


@dataclass
class CompileStats:
    """What compiling cost so far.

    Attributes:
        graphs_compiled: Dynamo graphs compiled (one per function and static variant when
            all is well).
        graph_breaks: graph breaks seen while tracing (0 under ``fullgraph=True``).
        recompiles: compilations of a function and variant that had already been
            compiled, i.e. guard failures on changing shapes or dtypes.
        compile_seconds: wall time of the calls that compiled.
    """

    graphs_compiled: int = 0
    graph_breaks: int = 0
    recompiles: int = 0
    compile_seconds: float = 0.0


class CompiledFunction:
    """``torch.compile(fn, fullgraph=True)`` called with dynamic batch dims.

    Args:
        fn: a module or function whose tensor arguments (and :class:`AttentionMetadata`)
            have the batch in dim 0; other arguments (KV-cache lists, flags) pass as is.
        stats: where compilations are counted (shared between functions); a new one by
            default.
        **compile_kwargs: passed to ``torch.compile`` (``mode``, ``backend``, ...).

    Call it as ``fn``.
    """

    def __init__(self, fn: Callable, stats: CompileStats | None = None, **compile_kwargs) -> None:
        self.compiled = torch.compile(fn, fullgraph=True, **compile_kwargs)
        self.stats = CompileStats() if stats is None else stats
        self._variants: set[tuple] = set()

    def __call__(self, *args, **kwargs):
        mark_batch_dynamic(*args, *kwargs.values())
        graphs, breaks, start = _graphs_compiled(), _graph_breaks(), time.perf_counter()
        with fx_config.patch(backed_size_oblivious=True):
            out = self.compiled(*args, **kwargs)
        compiled = _graphs_compiled() - graphs
        variant = _variant((*args, *kwargs.values()))
        seen = variant in self._variants
        self._variants.add(variant)
        if compiled:
            self.stats.graphs_compiled += compiled
            self.stats.compile_seconds += time.perf_counter() - start
            self.stats.recompiles += compiled if seen else compiled - 1
        self.stats.graph_breaks += _graph_breaks() - breaks
        return out
