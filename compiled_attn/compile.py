"""``torch.compile`` of a model forward with dynamic batch shapes and compile accounting.

Batch size and token count change every step. To get one graph per static variant
(pure prefill vs. the rest) and no recompiles, the batch dims of every metadata tensor
are marked dynamic before each call, and tracing runs with
``torch.fx.experimental._config.backed_size_oblivious`` so that a first call with one
token or one sequence does not specialize the graph to size 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters
from torch.fx.experimental import _config as fx_config

from .metadata import TENSOR_FIELDS, AttentionMetadata


def mark_batch_dynamic(md: AttentionMetadata) -> None:
    """Mark dim 0 (tokens or sequences) of every metadata tensor as dynamic."""
    for name in TENSOR_FIELDS:
        torch._dynamo.mark_dynamic(getattr(md, name), 0)


def _frames_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


@dataclass
class CompileStats:
    """What compiling cost so far.

    Attributes:
        graphs_compiled: Dynamo frames compiled (one per static variant when all is well).
        graph_breaks: graph breaks seen while tracing (0 under ``fullgraph=True``).
        recompiles: compilations of a variant (``prefill_only``, ``all_logits``) that had
            already been compiled, i.e. guard failures on changing shapes.
        compile_seconds: wall time of the calls that compiled.
    """

    graphs_compiled: int = 0
    graph_breaks: int = 0
    recompiles: int = 0
    compile_seconds: float = 0.0


class CompiledForward:
    """``torch.compile(model, fullgraph=True)`` called with dynamic batch dims.

    Args:
        model: a module with ``forward(md, kv_caches, all_logits=False)``.
        **compile_kwargs: passed to ``torch.compile`` (``mode``, ``backend``, ...).

    Call it as the model. ``stats`` counts compilations, graph breaks and recompiles.
    """

    def __init__(self, model: torch.nn.Module, **compile_kwargs) -> None:
        self.model = model
        self.compiled = torch.compile(model, fullgraph=True, **compile_kwargs)
        self.stats = CompileStats()
        self._variants: set[tuple[bool, bool]] = set()

    def __call__(self, md: AttentionMetadata, kv_caches, all_logits: bool = False) -> torch.Tensor:
        mark_batch_dynamic(md)
        frames, breaks, start = _frames_compiled(), _graph_breaks(), time.perf_counter()
        with fx_config.patch(backed_size_oblivious=True):
            out = self.compiled(md, kv_caches, all_logits)
        compiled = _frames_compiled() - frames
        variant = (md.prefill_only, all_logits)
        seen = variant in self._variants
        self._variants.add(variant)
        if compiled:
            self.stats.graphs_compiled += compiled
            self.stats.compile_seconds += time.perf_counter() - start
            self.stats.recompiles += compiled if seen else compiled - 1
        self.stats.graph_breaks += _graph_breaks() - breaks
        return out
