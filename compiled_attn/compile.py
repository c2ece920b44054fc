"""``torch.compile`` with dynamic batch shapes, and compile accounting.

Batch size and token count change every step. To get one graph per static variant
(pure prefill vs. the rest) and no recompiles, dim 0 (tokens or sequences) of every
batch tensor is marked dynamic before each call, and tracing runs with
``torch.fx.experimental._config.backed_size_oblivious`` so that a first call with one
token or one sequence does not specialize the graph to size 1. The model forward and the
sampler are compiled this way and counted in one :class:`CompileStats`.

Each :class:`CompiledFunction` owns its Dynamo cache. Dynamo keeps compiled graphs on the
*code object* of the frame it intercepts, and its recompile limit
(``torch._dynamo.config.recompile_limit``, 8) is counted per code object. Plain
``torch.compile(model)`` intercepts ``type(model).forward``, whose code object every
instance of the class shares: a process that compiles several models of one class (other
shapes, other weights) piles all their graphs onto one cache, and under ``fullgraph=True``
the ninth entry is a hard ``FailOnRecompileLimitHit``. So each instance compiles its own
entry function, a one-line trampoline ``fn(*args, **kwargs)`` whose code object is a
fresh copy (``CodeType.replace``) with a unique ``co_name``: Dynamo traces through the
trampoline into ``fn`` as usual, but caches, limits and keys its automatic-dynamic
(profile-guided) state per instance.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import Callable

import torch
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


@functools.cache
def _dynamo():
    """``(counters, _debug_get_cache_entry_list)`` of Dynamo, imported on the first compiled
    call (once): loading Dynamo costs about 1 s, which a program that imports compiled_attn
    and runs eagerly should not pay."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    return counters, _debug_get_cache_entry_list


def _graph_breaks() -> int:
    return sum(_dynamo()[0]["graph_break"].values())


_entry_ids = itertools.count()


def _entry_point(fn: Callable) -> Callable:
    """A function that calls ``fn``, with a code object of its own (named after ``fn``).

    The name is unique in the process because automatic-dynamic state is keyed by
    (file, first line, name), not by code object; the first line is left as it is, so
    tracebacks through the trampoline show its real source line.
    """
    def entry(*args, **kwargs):
        return fn(*args, **kwargs)

    base = getattr(fn, "__name__", None) or type(fn).__name__
    name = f"{base}__compiled_{next(_entry_ids)}"
    fields = {"co_name": name}
    if hasattr(entry.__code__, "co_qualname"):  # Python >= 3.11
        fields["co_qualname"] = name
    entry.__code__ = entry.__code__.replace(**fields)
    entry.__name__ = entry.__qualname__ = name
    return entry


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
    """``torch.compile(fn, fullgraph=True)`` called with dynamic batch dims, with a Dynamo
    cache of its own.

    Args:
        fn: a module or function whose tensor arguments (and :class:`AttentionMetadata`)
            have the batch in dim 0; other arguments (KV-cache lists, flags) pass as is.
        stats: where compilations are counted (shared between functions); a new one by
            default.
        **compile_kwargs: passed to ``torch.compile`` (``mode``, ``backend``, ...);
            ``fullgraph=True`` is accepted (and implied), so that it stands in for
            ``torch.compile(fn, fullgraph=True)``.

    Call it as ``fn``.

    Every instance compiles its own entry point (see the module docstring), so any number
    of instances, of the same module class or function, compile side by side in one
    process, each within its own ``recompile_limit``; ``torch._dynamo.reset()`` is never
    needed between them.

    Accounting reads this instance's own Dynamo cache: the graphs a call compiled are the
    cache entries it added to the entry point's code object
    (``torch._dynamo.eval_frame._debug_get_cache_entry_list``). Under ``fullgraph=True``
    an entry is exactly one compiled graph, and the entries are exactly what the recompile
    limit counts, so ``stats`` says how much of this function's budget is used. Unlike
    Dynamo's process-wide counters, nothing compiled for another function (another engine,
    another thread) is counted here. A call that adds an entry for a static variant
    (:func:`_variant`) seen before is a recompile: a guard failed on a shape, dtype or
    dispatch key.
    """

    def __init__(self, fn: Callable, stats: CompileStats | None = None, **compile_kwargs) -> None:
        if compile_kwargs.pop("fullgraph", True) is not True:
            raise ValueError("CompiledFunction always compiles with fullgraph=True; got fullgraph=False")
        self.fn = fn
        self.entry = _entry_point(fn)
        self.compiled = torch.compile(self.entry, fullgraph=True, **compile_kwargs)
        self.stats = CompileStats() if stats is None else stats
        self._variants: set[tuple] = set()

    @property
    def cache_entries(self) -> int:
        """Graphs in this function's Dynamo cache now (``recompile_limit`` caps them)."""
        return len(_dynamo()[1](self.entry.__code__))

    def __call__(self, *args, **kwargs):
        mark_batch_dynamic(*args, *kwargs.values())
        entries, breaks, start = self.cache_entries, _graph_breaks(), time.perf_counter()
        if not entries:  # torch._dynamo.reset() emptied the cache: compiling anew is no recompile
            self._variants.clear()
        with fx_config.patch(backed_size_oblivious=True):
            out = self.compiled(*args, **kwargs)
        compiled = max(self.cache_entries - entries, 0)
        variant = _variant((*args, *kwargs.values()))
        seen = variant in self._variants
        self._variants.add(variant)
        if compiled:
            self.stats.graphs_compiled += compiled
            self.stats.compile_seconds += time.perf_counter() - start
            self.stats.recompiles += compiled if seen else compiled - 1
        self.stats.graph_breaks += _graph_breaks() - breaks
        return out
