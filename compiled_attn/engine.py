"""The serving loop: continuous batching over a paged KV cache.

Requests arrive (:meth:`Engine.add_request`) and finish at different times. Each
:meth:`Engine.step` either prefills the requests admitted this step (one varlen batch,
run by the compiled model without graphs) or advances every running request by one token
(a decode step: a CUDA-graph replay when graphs are on and the batch fits the largest
capture size, the compiled model otherwise). Admission reserves the blocks a request can
ever need (prompt + ``max_new_tokens``), so a running request never runs out of cache;
requests that do not fit yet wait. Finished requests free their blocks at once.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.profiler import record_function

from .compile import CompiledFunction, CompileStats
from .graphs import CaptureStats, CUDAGraphRunner, DecodeBuffers, DecodeRow, decode_step, default_capture_sizes
from .kv_cache import KVCache, OutOfBlocksError
from .metadata import SequenceChunk, build_metadata
from .sampling import SamplingParams, sample


DEFAULT_CACHE_TOKENS = 65536
"""Cap of the default KV-cache size, in tokens."""


@dataclass
class Request:
    """One generation request and its result so far.

    Attributes:
        request_id: engine-wide id (also its sequence id in the block allocator).
        prompt_ids: the prompt token ids.
        params: its sampling parameters.
        seed: the seed its random draws are keyed by.
        output_ids: generated token ids (EOS included when it ended the sequence).
        finish_reason: ``None`` while running, then ``"length"`` or ``"eos"``.
    """

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def decode_row(self, block_table: Sequence[int]) -> DecodeRow:
        return DecodeRow(self.output_ids[-1], self.num_tokens - 1, block_table,
                         self.params.temperature, self.params.top_p, self.seed)


@dataclass
class Timings:
    """Wall times (seconds) and token counts of the steps of one :meth:`Engine.generate`."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Engine:
    """Runs a causal LM over a paged KV cache with continuous batching.

    Args:
        model: a :class:`~compiled_attn.models.DiffLlamaForCausalLM` (or a module with the
            same ``forward(md, kv_caches, all_logits)``, ``config`` and
            ``num_cache_layers``), already on its device and dtype.
        max_model_len: longest sequence (prompt + output); default the model's
            ``max_position_embeddings``.
        block_size: tokens per cache block.
        num_blocks: cache blocks; default enough for 8 sequences of ``max_model_len``, at
            most ``DEFAULT_CACHE_TOKENS`` tokens (a long-context checkpoint would otherwise
            ask for a huge cache).
        max_num_seqs: most requests decoding at once (also the largest capture size).
        compile: run the forward and the sampler through
            :class:`~compiled_attn.compile.CompiledFunction` (counted in ``compile_stats``).
        compile_kwargs: extra ``torch.compile`` arguments.
        cuda_graphs: replay decode steps as CUDA graphs (default: on for CUDA models).
        capture_sizes: batch sizes to capture; default
            :func:`~compiled_attn.graphs.default_capture_sizes` up to ``max_num_seqs``.

    Raises:
        ValueError: bad sizes, CUDA graphs asked for a CPU model.
    """

    def __init__(self, model: torch.nn.Module, *, max_model_len: int | None = None,
                 block_size: int = 16, num_blocks: int | None = None, max_num_seqs: int = 128,
                 compile: bool = True, compile_kwargs: dict | None = None,
                 cuda_graphs: bool | None = None, capture_sizes: Sequence[int] | None = None) -> None:
        config = model.config
        param = next(model.parameters())
        self.model, self.device, self.dtype = model, param.device, param.dtype
        self.max_model_len = max_model_len or config.max_position_embeddings
        for name, value in (("max_model_len", self.max_model_len), ("block_size", block_size),
                            ("max_num_seqs", max_num_seqs), ("num_blocks", 1 if num_blocks is None else num_blocks)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA model, the model is on {self.device}")
        self.max_blocks_per_seq = -(-self.max_model_len // block_size)
        if num_blocks is None:
            num_blocks = min(8 * self.max_blocks_per_seq, -(-DEFAULT_CACHE_TOKENS // block_size))
        self.kv_cache = KVCache.allocate(
            model.num_cache_layers, num_blocks, block_size, config.num_key_value_heads,
            config.head_dim, self.dtype, self.device,
        )
        self.eos_token_ids = config.eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.compile_stats = CompileStats() if compile else None
        self.forward = CompiledFunction(model, self.compile_stats, **(compile_kwargs or {})) if compile else model
        # Compiled, the sampler's ~60 small elementwise ops (hash noise, softmax, top-p) fuse
        # into a few kernels, which matters inside a replayed decode step.
        self.sampler = CompiledFunction(sample, self.compile_stats) if compile else sample
        self.buffers = DecodeBuffers(max_num_seqs, self.max_blocks_per_seq, block_size, self.device)
        self.capture_sizes = list(capture_sizes or default_capture_sizes(max_num_seqs))
        self.graph_runner: CUDAGraphRunner | None = None
        self.capture_stats: CaptureStats | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.timings = Timings()
        self._ids = itertools.count()
        self._decode_layout: tuple[tuple[int, ...], int] | None = None  # (request ids, rows) in buffers

    # --- requests ---------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                    seed: int | None = None, name: str = "prompt_ids") -> Request:
        """Queue a request; it is prefilled by a later :meth:`step`.

        Args:
            prompt_ids: the prompt's token ids.
            params: its sampling parameters.
            seed: its random seed unless ``params.seed`` is set (default: its request id).
            name: how errors name the prompt.

        Raises:
            ValueError: empty or out-of-vocabulary prompt, longer than ``max_model_len``
                with ``max_new_tokens``.
            OutOfBlocksError: the request alone needs more blocks than the cache has.
        """
        prompt = list(prompt_ids)
        self._check_prompt(prompt, params, name)
        request_id = next(self._ids)
        seed = params.seed if params.seed is not None else (request_id if seed is None else seed)
        request = Request(request_id, prompt, params, seed)
        allocator = self.kv_cache.allocator
        need = self._blocks_reserved(request)
        if need > allocator.num_blocks:
            raise OutOfBlocksError(
                f"a request of {len(prompt)} + {params.max_new_tokens} tokens needs "
                f"{need} blocks of {allocator.block_size}, the cache has "
                f"only {allocator.num_blocks} in all; raise num_blocks or lower max_new_tokens"
            )
        self.waiting.append(request)
        return request

    def _check_prompt(self, prompt: list[int], params: SamplingParams, name: str) -> None:
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError(f"{name} is empty; every prompt needs >= 1 token")
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"{name} has token ids outside [0, {vocab})")
        if len(prompt) + params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"{name} has {len(prompt)} tokens; with max_new_tokens={params.max_new_tokens} "
                f"it exceeds max_model_len={self.max_model_len}"
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_reserved(self, request: Request) -> int:
        """Blocks ``request`` can ever hold: prompt + max_new_tokens (+1 for the advance)."""
        tokens = min(len(request.prompt_ids) + request.params.max_new_tokens + 1, self.max_model_len)
        return -(-tokens // self.kv_cache.block_size)

    def _admit(self) -> list[Request]:
        allocator = self.kv_cache.allocator
        outstanding = sum(self._blocks_reserved(r) - len(allocator.block_tables.get(r.request_id, ()))
                          for r in self.running)
        free = allocator.num_free_blocks - outstanding
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            need = self._blocks_reserved(self.waiting[0])
            if need > free:
                break
            free -= need
            admitted.append(self.waiting.popleft())
        return admitted

    # --- steps ------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one prefill or one decode step; returns the requests that finished in it."""
        admitted = self._admit()
        start = time.perf_counter()
        if admitted:
            with record_function("prefill"):
                tokens = self._prefill(admitted)
            self.running.extend(admitted)
            batch = admitted
            self.timings.prefill_tokens += sum(len(r.prompt_ids) for r in admitted)
            self.timings.prefill_seconds += time.perf_counter() - start
        elif self.running:
            if self.cuda_graphs and self.graph_runner is None:
                self.capture()
                start = time.perf_counter()
            with record_function("decode_step"):
                tokens = self._decode(self.running)
            batch = list(self.running)
            self.timings.decode_tokens += len(batch)
            self.timings.decode_steps += 1
            self.timings.decode_seconds += time.perf_counter() - start
        else:
            return []
        finished = [r for r, t in zip(batch, tokens) if self._append(r, t)]
        for r in finished:
            self.running.remove(r)
            self.kv_cache.allocator.free(r.request_id)
        return finished

    def _prefill(self, requests: list[Request]) -> list[int]:
        allocator = self.kv_cache.allocator
        chunks = [SequenceChunk(r.prompt_ids, 0, allocator.allocate(r.request_id, len(r.prompt_ids)))
                  for r in requests]
        md = build_metadata(chunks, self.kv_cache.block_size, self.max_blocks_per_seq, self.device,
                            allocator.num_blocks)
        def column(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        # no_grad, not inference_mode: the decode step's static buffers are ordinary tensors,
        # and inputs of both kinds would make the compiled sampler recompile.
        with torch.no_grad():
            logits = self.forward(md, self.kv_cache.layers)
            tokens = self.sampler(
                logits,
                column([r.params.temperature for r in requests], torch.float32),
                column([r.params.top_p for r in requests], torch.float32),
                column([r.seed for r in requests], torch.int64),
                column([len(r.prompt_ids) for r in requests], torch.int64),
            )
        return tokens.tolist()

    def _decode(self, requests: list[Request]) -> list[int]:
        """One token for every running request through the static decode buffers."""
        allocator, block_size = self.kv_cache.allocator, self.kv_cache.block_size
        rows = len(requests)
        size = self._graph_size(rows)
        layout = (tuple(r.request_id for r in requests), size or rows)
        new_blocks = []
        for row, r in enumerate(requests):  # room for this token and the advance's next slot
            table = allocator.block_tables[r.request_id]
            before = len(table)
            allocator.allocate(r.request_id, min(r.num_tokens + 1, self.max_model_len))
            new_blocks += [(row, i, table[i]) for i in range(before, len(table))]
        if layout != self._decode_layout:
            self.buffers.write([r.decode_row(allocator.block_tables[r.request_id]) for r in requests], layout[1])
            self._decode_layout = layout
        else:
            for row, index, block in new_blocks:
                self.buffers.set_block(row, index, block)
        with torch.no_grad():
            if size is not None:
                with record_function("replay"):
                    tokens = self.graph_runner.replay(size)[:rows]
            else:
                tokens = decode_step(self.forward, self.kv_cache.layers, self.buffers, rows, self.sampler)
        return tokens.tolist()

    def _graph_size(self, rows: int) -> int | None:
        """The capture size this batch replays, or ``None`` to run without graphs."""
        return self.graph_runner.padded_size(rows) if self.cuda_graphs else None

    def capture(self) -> CaptureStats:
        """Capture the decode step for every capture size (done once, before the first
        decode step; it compiles the decode graph first when compiling)."""
        def step(rows: int) -> torch.Tensor:
            return decode_step(self.forward, self.kv_cache.layers, self.buffers, rows, self.sampler)

        with record_function("capture"), torch.no_grad():
            self.buffers.write([], self.buffers.max_rows)  # all padding while capturing
            runner = CUDAGraphRunner(step, [s for s in self.capture_sizes if s <= self.max_num_seqs])
            self.capture_stats = runner.capture()
        self.graph_runner, self._decode_layout = runner, None
        return self.capture_stats

    def _append(self, request: Request, token: int) -> bool:
        """Add ``token``; returns True when the request is finished."""
        request.output_ids.append(token)
        if token in self.eos_token_ids:
            request.finish_reason = "eos"
        elif len(request.output_ids) >= request.params.max_new_tokens:
            request.finish_reason = "length"
        return request.finish_reason is not None

    # --- batch API ------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 seed: int = 0, on_step: Callable[[], None] | None = None) -> tuple[list[Request], Timings]:
        """Generate a completion for every prompt (continuous batching until all finish).

        Args:
            prompts: token id lists, each non-empty.
            params: one :class:`SamplingParams` for all prompts or one per prompt.
            seed: request ``i`` draws with seed ``seed * 1_000_003 + i`` unless its params
                carry a seed (same seed, same tokens; independent of batching).
            on_step: called after every step (e.g. :meth:`StepProfiler.step`).

        Returns:
            The finished requests in prompt order, and the timings of this call.

        Raises:
            ValueError: no prompts, a params list of the wrong length, bad prompts (see
                :meth:`add_request`); nothing is queued then.
            OutOfBlocksError: a request can never fit the cache.
        """
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if not prompts:
            raise ValueError("prompts must hold at least one prompt")
        if len(params) != len(prompts):
            raise ValueError(f"params must be one SamplingParams or one per prompt; got {len(params)} for {len(prompts)} prompts")
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; step() the queued requests first")
        self.timings = Timings()
        try:
            requests = [self.add_request(prompt, p, seed * 1_000_003 + i, name=f"prompts[{i}]")
                        for i, (prompt, p) in enumerate(zip(prompts, params))]
            while self.has_unfinished():
                self.step()
                if on_step is not None:
                    on_step()
        finally:
            for r in [*self.waiting, *self.running]:
                self.kv_cache.allocator.free(r.request_id)
            self.waiting.clear()
            self.running.clear()
        return requests, self.timings
