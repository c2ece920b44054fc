"""The serving loop: continuous batching over a paged KV cache.

Requests arrive (:meth:`Engine.add_request`) and finish at different times. Each
:meth:`Engine.step` asks the :class:`~compiled_attn.scheduler.Scheduler` what runs (prefill
chunks and decode rows within a token budget, blocks allocated as sequences grow,
preemption when the cache runs out, prefix-cache hits) and has the
:class:`~compiled_attn.model_runner.ModelRunner` run it: a step with any prefill chunk is one
mixed forward over the paged cache (a CUDA-graph replay when graphs are on and it fits a
captured ``(tokens, seqs)`` shape, see :mod:`compiled_attn.mixed_graphs`); a step that
advances every running request by one token is a decode step (a CUDA-graph replay when
graphs are on and the batch fits the largest capture size). Otherwise the compiled model
runs. Finished requests free their blocks at once.

Decode tokens are read one step late (``async_decode``, vLLM's "async scheduling"): a decode
step is left in flight, its tokens on their way to pinned host memory, and when the next
step is a decode over the same rows it is launched before those tokens are read, so the
host's bookkeeping and launch overlap the device's work. The step advances its own inputs
on the device (:func:`~compiled_attn.step_inputs.advance`), which is what lets it run before the
host has seen the previous tokens. A request that arrives meanwhile is admitted the same
way: the mixed step that prefills it is launched behind the decode step in flight, its decode
rows taking their input tokens from that step's output on the device. Everything runs in
order on one CUDA stream.
"""

from __future__ import annotations

import itertools
import operator
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.profiler import record_function

from .compile import CompiledFunction, CompileStats
from .graphs import default_capture_sizes
from .kv_cache import KVCache, OutOfBlocksError, resolve_kv_cache_dtype
from .mixed_graphs import check_mixed_capture_sizes, default_mixed_capture_sizes
from .model_runner import InflightStep, ModelRunner
from .ops.arith import cdiv
from .request_sync import RequestSync
from .sampling import SamplingParams, check_seed, sample
from .scheduler import Chunk, Request, Scheduler, check_token_budget
from .tokenizer import check_token_ids
from .warmup import warmup_batches

__all__ = ["DEFAULT_CACHE_TOKENS", "Engine", "InflightStep", "Request", "Timings", "engine_mode"]

DEFAULT_CACHE_TOKENS = 65536
"""Cap of the default KV-cache size, in tokens."""

LAUNCH_LEAD_SECONDS = 3e-4
"""``step(wait=False)``: the next decode step is queued behind the one in flight once that
one is expected to end within this many seconds (more than a decode launch's host time), so
the device does not wait for the launch."""


@contextmanager
def engine_mode():
    """The one autograd mode the engine makes and uses its tensors in, whatever the
    caller's: inference mode off, gradients off.

    Dynamo guards on a tensor's dispatch keys, and a tensor made under
    ``torch.inference_mode()`` lacks the autograd ones, so metadata or sampler inputs made
    in the caller's mode would recompile the compiled model and sampler when the caller
    switches between ``inference_mode``, ``no_grad`` and neither. Inference mode is off
    (not on) because the KV cache and the decode buffers are written in place on every
    step, which an inference tensor refuses outside inference mode; an engine built under
    ``inference_mode`` still gets ordinary tensors. (``inference_mode(False)`` turns
    gradients back on, hence ``no_grad`` inside it.)
    """
    with torch.inference_mode(False), torch.no_grad():
        yield


@dataclass
class Timings:
    """Wall times (seconds) and token counts of the steps of one :meth:`Engine.generate`.

    Decode counts cover decode steps launched (``decode_steps``; ``overlapped_steps`` of
    them launched before the previous step's tokens were read) and tokens delivered
    (``decode_tokens``: a token sampled past an EOS is dropped, not counted);
    ``decode_seconds`` is the wall time spent launching decode steps and reading their tokens.
    ``behind_steps``: mixed steps launched behind a decode step in flight (they admitted
    requests while others decoded). ``idle_polls``: ``step(wait=False)`` calls that
    returned at once, the step in flight not near its end.
    """

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    overlapped_steps: int = 0
    behind_steps: int = 0
    idle_polls: int = 0

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
        max_num_seqs: most requests running at once (also the largest capture size).
        max_num_batched_tokens: most tokens computed in one step (prefill chunks plus decode
            rows); a longer prompt is prefilled in chunks over several steps, beside the
            decode rows (chunked prefill). ``None``: no limit.
        enable_prefix_caching: reuse the cached blocks of a prompt's longest cached prefix
            (automatic prefix caching); outputs are the same with it off.
        compile: run the forward and the sampler through
            :class:`~compiled_attn.compile.CompiledFunction` (counted in ``compile_stats``).
        compile_kwargs: extra ``torch.compile`` arguments.
        cuda_graphs: replay decode and mixed steps as CUDA graphs (default: on for CUDA
            models).
        capture_sizes: decode batch sizes to capture; default
            :func:`~compiled_attn.graphs.default_capture_sizes` up to ``max_num_seqs``.
        mixed_capture_sizes: ``(tokens, seqs)`` shapes of mixed steps to capture; default
            :func:`~compiled_attn.mixed_graphs.default_mixed_capture_sizes`; ``[]``: none
            (mixed steps run the compiled model).
        async_decode: read a decode step's tokens one step late, launching the next decode
            step first when it can (see :meth:`step`); off, each decode step waits for its
            own tokens.
        warmup: run :meth:`warmup` at the end of construction, so that compiling (Dynamo,
            Inductor, Triton) and graph capture happen before the first request.
        kv_cache_dtype: ``"auto"`` (the model's dtype) or ``"fp8"`` / ``"fp8_e4m3"`` (a
            float8_e4m3fn cache with per-layer scales: half of bfloat16's bytes per token;
            vLLM's ``kv_cache_dtype``). See :mod:`compiled_attn.kv_cache`.
        kv_scales: fp8 only: one ``(k_scale, v_scale)`` pair of floats per cache layer, e.g.
            from :func:`~compiled_attn.kv_cache.calibrate_kv_scales`; default 1.0.

    Raises:
        ValueError: bad sizes (``max_model_len`` above the model's
            ``max_position_embeddings``, ``max_num_batched_tokens`` below ``block_size`` or
            ``max_num_seqs``, a mixed capture shape that is not a pair ``1 <= seqs <=
            tokens``), CUDA graphs asked for a CPU model, an unknown ``kv_cache_dtype``, bad
            ``kv_scales`` (or ``kv_scales`` without an fp8 cache).
        TypeError: a size that is not an int, a flag that is not a bool.
    """

    def __init__(self, model: torch.nn.Module, *, max_model_len: int | None = None,
                 block_size: int = 16, num_blocks: int | None = None, max_num_seqs: int = 128,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 compile: bool = True, compile_kwargs: dict | None = None,
                 cuda_graphs: bool | None = None, capture_sizes: Sequence[int] | None = None,
                 mixed_capture_sizes: Sequence[tuple[int, int]] | None = None, async_decode: bool = True,
                 warmup: bool = True, kv_cache_dtype: str = "auto",
                 kv_scales: Sequence[tuple[float, float]] | None = None) -> None:
        config = model.config
        param = next(model.parameters())
        self.model, self.device, self.dtype = model, param.device, param.dtype
        # A tensor-parallel shard's own head counts (compiled_attn.models.sharding): its cache
        # holds this rank's KV heads; every rank runs the same schedule on the gathered logits.
        self.local_config = getattr(model, "tp_config", config)
        self.max_model_len = config.max_position_embeddings if max_model_len is None else max_model_len
        sizes = {"max_model_len": self.max_model_len, "block_size": block_size, "max_num_seqs": max_num_seqs,
                 "num_blocks": 1 if num_blocks is None else num_blocks}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_model_len > config.max_position_embeddings:  # as vLLM's model config refuses it
            raise ValueError(f"max_model_len ({self.max_model_len}) is greater than the model's "
                             f"max_position_embeddings ({config.max_position_embeddings})")
        flags = {"enable_prefix_caching": enable_prefix_caching, "compile": compile, "async_decode": async_decode,
                 "warmup": warmup, "cuda_graphs": False if cuda_graphs is None else cuda_graphs}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        check_token_budget(max_num_batched_tokens, max_num_seqs, block_size)  # before any allocation
        if mixed_capture_sizes is not None:
            mixed_capture_sizes = check_mixed_capture_sizes(mixed_capture_sizes)
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA model, the model is on {self.device}")
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)  # a torch dtype
        self.max_blocks_per_seq = cdiv(self.max_model_len, block_size)
        if num_blocks is None:
            num_blocks = min(8 * self.max_blocks_per_seq, cdiv(DEFAULT_CACHE_TOKENS, block_size))
        with engine_mode():  # never inference tensors: the steps write them in place
            self.kv_cache = KVCache.allocate(
                model.num_cache_layers, num_blocks, block_size, self.local_config.num_key_value_heads,
                config.head_dim, self.kv_cache_dtype, self.device, prefix_caching=enable_prefix_caching,
                kv_scales=kv_scales,
            )
            self.compile_stats = CompileStats() if compile else None
            forward = CompiledFunction(model, self.compile_stats, **(compile_kwargs or {})) if compile else model
            # Compiled, the sampler's ~60 small elementwise ops (hash noise, softmax, top-p) fuse
            # into a few kernels, which matters inside a replayed decode step.
            sampler = CompiledFunction(sample, self.compile_stats) if compile else sample
            capture_sizes = list(capture_sizes or default_capture_sizes(max_num_seqs)) if self.cuda_graphs else None
            if mixed_capture_sizes is None:
                mixed_capture_sizes = default_mixed_capture_sizes(max_num_seqs, max_num_batched_tokens)
            mixed_capture_sizes = mixed_capture_sizes if self.cuda_graphs else []
            self.runner = ModelRunner(forward, sampler, self.kv_cache, max_num_seqs, self.max_blocks_per_seq,
                                      capture_sizes, mixed_capture_sizes)
        self.scheduler = Scheduler(self.kv_cache.allocator, max_num_seqs, max_num_batched_tokens, self.max_model_len)
        self.eos_token_ids = config.eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.async_decode = async_decode
        self.timings = Timings()
        self._ids = itertools.count()
        self._inflight: InflightStep | None = None  # the last decode step, until its tokens are read
        self._decode_device_seconds = 0.0  # the last decode step's, on the device (CUDA events)
        tp = getattr(model, "tp", None)  # tensor parallelism: rank 0's requests on every rank
        self._sync = RequestSync(tp) if tp is not None and tp.world_size > 1 else None
        if self._sync is not None:
            self._sync.check_engine(dict(
                max_model_len=self.max_model_len, block_size=block_size, num_blocks=num_blocks,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                enable_prefix_caching=enable_prefix_caching, compile=compile, cuda_graphs=self.cuda_graphs,
                capture_sizes=capture_sizes, mixed_capture_sizes=mixed_capture_sizes, async_decode=async_decode,
                warmup=warmup, kv_cache_dtype=str(self.kv_cache_dtype), kv_scales=kv_scales, model_config=config,
                model_dtype=str(self.dtype), all_reduce=tp.all_reduce))
        self._warming_up = False
        self.warmup_seconds = self.warmup() if warmup else 0.0

    # --- requests ---------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                    seed: int | None = None, name: str = "prompt_ids") -> Request:
        """Queue a request; a later :meth:`step` admits it.

        Args:
            prompt_ids: the prompt's token ids.
            params: its sampling parameters.
            seed: its random seed unless ``params.seed`` is set (default: its request id;
                ids count up from 0 in the order requests are added, a request with
                ``params.n`` samples taking ``n`` of them).
            name: how errors name the prompt.

        Raises:
            TypeError: a token id that is not an integer (e.g. a float), ``params`` that is not a
                :class:`SamplingParams`, or a ``seed`` that is not an int.
            ValueError: empty or out-of-vocabulary prompt, longer than ``max_model_len``
                with ``max_new_tokens``; ``seed`` outside ``[0, 2**63)``; ``params.n``
                above ``max_num_seqs``.
            OutOfBlocksError: the request alone needs more blocks than the cache has.
        """
        try:
            prompt = list(map(operator.index, prompt_ids))
        except TypeError:
            raise TypeError(f"{name} must hold integer token ids, got {list(prompt_ids)[:8]}") from None
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__} {params!r:.80}")
        self._check_prompt(prompt, params, name)
        if seed is not None:
            check_seed(seed)
        if params.n > self.max_num_seqs:
            raise ValueError(f"params.n={params.n} samples cannot run beside each other with "
                             f"max_num_seqs={self.max_num_seqs}")
        allocator = self.kv_cache.allocator
        need = self.scheduler.blocks_reserved(len(prompt), params.max_new_tokens)
        if need > allocator.num_blocks:
            raise OutOfBlocksError(
                f"a request of {len(prompt)} + {params.max_new_tokens} tokens needs "
                f"{need} blocks of {allocator.block_size}, the cache has "
                f"only {allocator.num_blocks} in all; raise num_blocks or lower max_new_tokens"
            )
        request_id = next(self._ids)  # (taken once the request is valid)
        # Its samples' ids are taken now, whenever they fork, so later requests' ids (and
        # default seeds) do not depend on the schedule.
        self._ids = itertools.count(request_id + params.n)
        seed = params.seed if params.seed is not None else (request_id if seed is None else seed)
        request = Request(request_id, prompt, params, seed)
        if self._sync is None:
            self.scheduler.add(request)
        else:  # the scheduler takes it from the next step's exchange, on every rank at once
            self._sync.add(request)
        return request

    def _check_prompt(self, prompt: list[int], params: SamplingParams, name: str) -> None:
        check_token_ids(prompt, self.model.config.vocab_size, name)
        if len(prompt) + params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"{name} has {len(prompt)} tokens; with max_new_tokens={params.max_new_tokens} "
                f"it exceeds max_model_len={self.max_model_len}"
            )

    def has_unfinished(self) -> bool:
        """Whether a :meth:`step` has work left: waiting or running requests, or a decode
        step in flight (whose tokens may still finish requests or have to be dropped)."""
        return (self.scheduler.has_unfinished() or self._inflight is not None
                or (self._sync is not None and self._sync.pending))

    # --- steps ------------------------------------------------------------------------

    @engine_mode()
    def step(self, wait: bool = True) -> list[Request]:
        """Run one step; returns the requests that finished in it (their last token was read).

        ``wait=False`` (a serving loop that polls, adding requests as they arrive): while
        the decode step in flight is expected to run for more than
        :data:`LAUNCH_LEAD_SECONDS` and no waiting request can be launched behind it, return
        ``[]`` at once and launch nothing. The next decode step is then queued only near the
        end of the one in flight, so a request that arrives meanwhile is prefilled right
        after it, not after one more decode step (:meth:`_too_early`).

        It runs in :func:`engine_mode` whatever the caller's mode (``inference_mode``,
        ``no_grad`` or neither), so the compiled model and sampler see the same kind of
        tensors on every call.

        With ``async_decode`` a decode step stays in flight after its launch and its tokens
        are read by the next call. That call, when it would run a decode over the same rows
        anyway (:meth:`_can_overlap`), launches it first and then reads the in-flight step's
        tokens, so the host works while the device runs. When a waiting request can be
        admitted instead, it launches the mixed step that admits it behind the in-flight
        step, the rows fed their in-flight tokens on the device (:meth:`_run_chunks_behind`),
        and then reads both. Otherwise it drains the in-flight step first (reads, appends,
        finishes), then runs what the scheduler picks: a mixed step when it holds a prefill
        chunk, else a decode step. A request may thus have one
        token too many sampled (past an EOS that was not read yet); :meth:`_drain` drops it,
        so every output equals a synchronous engine's. With tensor parallelism, every rank
        first queues the requests rank 0 added since its last step
        (:mod:`compiled_attn.request_sync`).
        """
        if not wait and self._sync is not None:
            raise ValueError("step(wait=False) runs without tensor parallelism (every rank steps in lock-step)")
        behind = self._sync is None and self._can_launch_behind()
        if not wait and not behind and self._too_early():
            self.timings.idle_polls += 1
            return []
        if self._sync is not None:  # rank 0's new requests, before anything is decided
            with record_function("request_sync"):
                for request in self._sync.exchange():
                    self.scheduler.add(request)
                    self._ids = itertools.count(max(request.request_id + request.params.n, next(self._ids)))
            if self._sync.stopped:
                return []
            behind = self._can_launch_behind()
        running = self.scheduler.running
        if behind:
            return self._run_chunks_behind()
        if self._can_overlap():
            with self._decode_phase():
                launched = self.runner.launch_decode(list(running), self.scheduler.allocate_decode(1), 1)
                self.timings.decode_steps += 1
                finished = self._drain()
                launched.started()  # it began as the drained one ended: note it before the host moves on
                self._inflight = launched
            self.timings.overlapped_steps += 1
            return finished
        finished = self._drain() if self._inflight is not None else []
        scheduled = self.scheduler.schedule()
        chunks = scheduled.chunks
        if not chunks:
            return finished
        self.runner.copy_blocks(scheduled.copies)
        if len(chunks) == len(running) and all(c.num_tokens == 1 and c.request.decoding for c in chunks):
            if self.cuda_graphs and self.runner.graph_runner is None:
                self.runner.capture()
            with self._decode_phase():
                self._inflight = self.runner.launch_decode(list(running), self.scheduler.allocate_decode(0), 0)
                self.timings.decode_steps += 1
                if not self.async_decode:
                    finished += self._drain()
        else:
            finished += self._run_chunks(chunks)
        return finished

    def _too_early(self) -> bool:
        """``step(wait=False)`` with no waiting request to launch behind the decode step in
        flight (the caller checks): that step's tokens are not ready, and the stream has
        not reached it yet or it is expected to run for more than
        :data:`LAUNCH_LEAD_SECONDS` still (its device time taken as the last decode step's,
        measured by CUDA events; 0 until one is measured, and after the warm-up). The lead
        must exceed the host time of the next decode launch (0.08-0.13 ms median on the
        H200's host), or the device waits for it; leads of 120, 150 and 300 us gave TTFT
        p50 3.67, 3.57 and 3.47-3.51 ms in ``profiling/bench_serving.py --poll`` (one run
        each, 2026-12-01; ``profiling/results/serving.md``)."""
        inflight = self._inflight
        if inflight is None or inflight.ready():
            return False
        started = inflight.started()
        if started is None:
            return inflight.start is not None  # queued behind earlier work
        return time.perf_counter() - started < self._decode_device_seconds - LAUNCH_LEAD_SECONDS

    def _can_launch_behind(self) -> bool:
        """Whether a mixed step can be launched behind the in-flight decode step, before its
        tokens are read (:meth:`_run_chunks_behind`): the in-flight rows are exactly the
        running requests, as for :meth:`_can_overlap` no row reaches ``max_new_tokens`` with
        its in-flight token, and a waiting request can be admitted beside the rows' next
        blocks (plus one each for a copy-on-write). So the step admits a request, and it
        preempts no running one (none is queued with a stand-in token)."""
        return (self._inflight_rows_go_on()
                and self.scheduler.can_admit(
                    reserved_blocks=self.scheduler.next_decode_blocks() + len(self.scheduler.running)))

    def _run_chunks_behind(self) -> list[Request]:
        """A mixed step launched behind the in-flight decode step (vLLM's async scheduling
        for steps that admit requests); returns the requests finished in both.

        The in-flight step computes each row's pending token and samples the next; the
        scheduler is told so at once (``computed``), and each row gets a stand-in token, so
        this step schedules the rows' next decode with the new prompts. The launch feeds the
        stand-ins' real ids from the in-flight step's device tokens; then the in-flight step
        is drained (its tokens replace the stand-ins) while this step runs, and this step's
        tokens are read. A row whose in-flight token was an EOS is finished by the drain and
        its token from this step dropped, as for an overlapped decode step.
        """
        inflight = self._inflight
        for request in inflight.requests:
            self.scheduler.computed(request, 1)
            request.output_ids.append(0)  # a stand-in for the in-flight token
        inflight.stand_ins = True
        self.timings.behind_steps += 1
        scheduled = self.scheduler.schedule()
        self.runner.copy_blocks(scheduled.copies)
        return self._run_chunks(scheduled.chunks, behind=inflight)

    def _run_chunks(self, chunks: list[Chunk], behind: InflightStep | None = None) -> list[Request]:
        """A mixed step (prefill chunks and decode rows); returns the requests it finished.

        A request with ``n > 1`` samples whose prompt this step completes gets its other
        ``n - 1`` samples here, each drawing its first token from the same logits.
        ``behind``: the decode step in flight that this one is launched behind (see
        :meth:`_run_chunks_behind`), drained between this step's launch and its read."""
        if self.runner.mixed_capture_pending and not self._warming_up:
            self.runner.capture_mixed()  # (warm-up captures at its end, after its compiled mixed steps)
        start = time.perf_counter()
        draws = [(i, c.request) for i, c in enumerate(chunks)]  # (chunk, request drawing a token)
        for i, chunk in enumerate(chunks):
            parent = chunk.request
            if chunk.completes and parent.params.n > 1 and not parent.samples and not parent.output_ids:
                draws += [(i, child) for child in self.scheduler.sample_requests(parent)]
        feed = None
        if behind is not None:
            rows = {r.request_id: row for row, r in enumerate(behind.requests)}
            feed = (behind.device_tokens, [(i, rows[c.request.request_id]) for i, c in enumerate(chunks)
                                           if c.request.request_id in rows])
        with record_function("prefill"):
            launched = self.runner.launch_chunks(chunks, draws, feed)
        drained = self._drain() if behind is not None else []
        with record_function("prefill"):
            tokens = launched.tolist()
        finished = []
        for chunk, token in zip(chunks, tokens):
            if chunk.request.finish_reason is not None:  # ended by its in-flight token (an EOS)
                continue
            completes, decode_row = chunk.completes, chunk.request.decoding
            self.scheduler.computed(chunk.request, chunk.num_tokens)
            if decode_row:
                self.timings.decode_tokens += 1
            else:
                self.timings.prefill_tokens += chunk.num_tokens
            if completes and self._append(chunk.request, token):
                finished.append(chunk.request)
        for (i, child), token in zip(draws[len(chunks):], tokens[len(chunks):]):
            self.scheduler.fork(chunks[i].request, child)
            if self._append(child, token):
                finished.append(child)
        self.timings.prefill_seconds += time.perf_counter() - start
        return drained + self._finish(finished)

    def _can_overlap(self) -> bool:
        """Whether the next decode step can be launched before the in-flight step's tokens
        are read: it is the step that draining first would launch (but for rows that an
        in-flight EOS ends), on the inputs the device already holds.

        That holds when the in-flight step's rows are still exactly the running requests
        (so the buffers it advanced on the device are the next step's inputs, and no row
        needs rewriting from the host), no waiting request can be admitted (no prefill comes
        first), no row reaches ``max_new_tokens`` with the in-flight token (it would leave
        the batch), and the cache has the blocks the step needs without preempting (the
        budget, at least ``max_num_seqs``, holds every row). Only an EOS among the in-flight
        tokens is unknown; see :meth:`step`.
        """
        return (self._inflight_rows_go_on()
                and not self.scheduler.can_admit()
                and self.scheduler.next_decode_blocks() <= self.kv_cache.allocator.num_free_blocks)

    def _inflight_rows_go_on(self) -> bool:
        """A decode step is in flight (``async_decode``), its rows are exactly the running
        requests, and none reaches ``max_new_tokens`` with its in-flight token."""
        inflight, running = self._inflight, self.scheduler.running
        return (self.async_decode and inflight is not None
                and [r.request_id for r in inflight.requests] == [r.request_id for r in running]
                and all(len(r.output_ids) + 1 < r.params.max_new_tokens for r in running))

    @contextmanager
    def _decode_phase(self):
        """Label (``decode_step``) and time (``Timings.decode_seconds``) decode launches and reads."""
        start = time.perf_counter()
        with record_function("decode_step"):
            yield
        self.timings.decode_seconds += time.perf_counter() - start

    def _drain(self) -> list[Request]:
        """Wait for the in-flight step's tokens, append them and finish requests; returns
        the finished ones.

        A row whose request has finished already (by an EOS read from the step before,
        while this one was in flight) sampled past its end: its token is dropped.
        """
        inflight, self._inflight = self._inflight, None
        finished = []
        tokens = inflight.read()
        self._decode_device_seconds = inflight.device_seconds() or self._decode_device_seconds
        for request, token in zip(inflight.requests, tokens):
            if request.finish_reason is None:
                self.timings.decode_tokens += 1
                if inflight.stand_ins:  # counted computed at the launch behind it (_run_chunks_behind)
                    request.output_ids.pop()
                else:
                    self.scheduler.computed(request, request.num_tokens - request.num_computed)
                if self._append(request, token):
                    finished.append(request)
        return self._finish(finished)

    def _finish(self, finished: list[Request]) -> list[Request]:
        """Take finished requests out of the batch and free their blocks; returns them.

        A decode step still in flight may write the K/V of a request finished here (the
        step sampling past its EOS). Freeing its blocks now is safe only because all the
        engine's device work (steps, replays, block-table and buffer writes) is enqueued on
        one stream, in order: whatever reuses these blocks is enqueued later, so it runs
        after that step.
        """
        for r in finished:
            self.scheduler.finish(r)
        return finished

    def serve_worker(self) -> None:
        """On a tensor-parallel rank other than 0: step in lock-step with rank 0, running
        the requests rank 0 adds (:mod:`compiled_attn.request_sync`), until rank 0 calls
        :meth:`stop_workers`. Each step waits for rank 0's next one.

        Raises:
            RuntimeError: no tensor parallelism, or called on rank 0.
        """
        if self._sync is None or self._sync.leader:
            raise RuntimeError("serve_worker() runs on tensor-parallel ranks other than 0")
        self._sync.stopped = False
        while not self._sync.stopped:
            self.step()

    def stop_workers(self) -> None:
        """On tensor-parallel rank 0, once idle: end the other ranks' :meth:`serve_worker`.
        It is a collective: it waits until every other rank is in ``serve_worker``.

        Raises:
            RuntimeError: no tensor parallelism, not rank 0, requests still unfinished, or
                the workers stopped already (no step since the last ``stop_workers``).
        """
        if self._sync is None or not self._sync.leader or self.has_unfinished():
            raise RuntimeError("stop_workers() runs on tensor-parallel rank 0 once its requests are done")
        if self._sync.stopped:
            raise RuntimeError("stop_workers() was called already: the other ranks have left serve_worker()")
        self._sync.exchange(stop=True)

    def capture(self):
        """Capture the decode step for every capture size and the mixed step for every
        mixed shape, where not captured yet (done once: by the warm-up, else before the first
        decode or mixed step; it compiles the graphs first when compiling). Returns the
        decode graphs' :class:`~compiled_attn.graphs.CaptureStats`."""
        with engine_mode():
            if self.runner.graph_runner is None:
                self.runner.capture()
            if self.runner.mixed_capture_pending:
                self.runner.capture_mixed()
        return self.runner.capture_stats

    @property
    def capture_stats(self):
        """What capturing the decode CUDA graphs cost, or ``None`` before (or without) graphs
        (the mixed steps': ``runner.mixed_capture_stats``)."""
        return self.runner.capture_stats

    def _append(self, request: Request, token: int) -> bool:
        """Add ``token``; returns True when the request is finished."""
        request.output_ids.append(token)
        if token in self.eos_token_ids:
            request.finish_reason = "eos"
        elif len(request.output_ids) >= request.params.max_new_tokens:
            request.finish_reason = "length"
        return request.finish_reason is not None

    # --- warm-up ----------------------------------------------------------------------------

    def warmup(self) -> float:
        """Compile ahead of the first request what the steps can launch; returns seconds.

        Runs synthetic requests (token id 0) through the ordinary steps: one prefill and one
        decode step (compiling the model and the sampler, capturing the CUDA graphs), and on
        CUDA one prefill per Triton kernel variant that a prefill batch within this engine's
        limits can reach, over contiguous k/v and over the paged cache (a mixed step, chunked
        prefill or a prefix hit runs the paged kernel at prefill sizes), plus one decode step
        per variant of the batch sizes that run without a graph
        (:func:`~compiled_attn.warmup.warmup_batches`).
        Triton keeps what it compiled, so later requests reuse it; the timings and the cache
        are left as before.
        """
        start = time.perf_counter()
        allocator = self.kv_cache.allocator
        prefix_caching, allocator.prefix_caching = allocator.prefix_caching, False  # every batch runs whole
        self._warming_up = True
        try:
            for num_seqs, prompt_len, new_tokens, paged in warmup_batches(self):
                self.runner.paged_prefill = paged
                self.generate([[0] * prompt_len] * num_seqs, SamplingParams(max_new_tokens=new_tokens))
        finally:
            allocator.prefix_caching, self.runner.paged_prefill, self._warming_up = prefix_caching, False, False
        if self.cuda_graphs:
            self.capture()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # As if no request had run: request ids (default seeds) from 0, decode buffers to rewrite.
        self.timings, self._ids, self.runner.decode_layout = Timings(), itertools.count(), None
        self._decode_device_seconds = 0.0  # (warm-up steps compiled while they ran)
        self.scheduler.num_preemptions = 0
        return time.perf_counter() - start

    # --- batch API ------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 seed: int = 0, on_step: Callable[[], None] | None = None) -> tuple[list[Request], Timings]:
        """Generate a completion for every prompt (continuous batching until all finish).

        Args:
            prompts: token id lists, each non-empty.
            params: one :class:`SamplingParams` for all prompts or one per prompt.
            seed: request ``i`` draws with seed ``(seed * 1_000_003 + i) mod 2**63`` unless its params
                carry a seed (same seed, same tokens; independent of batching).
            on_step: called after every step (e.g. :meth:`StepProfiler.step`).

        Returns:
            The finished requests in prompt order (with ``n > 1``, each request's other
            samples in its ``samples``), and the timings of this call.

        Raises:
            TypeError: ``params`` that is not a SamplingParams or a sequence of them; a
                ``seed`` that is not an int.
            ValueError: no prompts, a params list of the wrong length, bad prompts (see
                :meth:`add_request`); nothing is queued then.
            OutOfBlocksError: a request can never fit the cache.
        """
        if not isinstance(params, SamplingParams) and not (isinstance(params, Sequence) and all(
                isinstance(p, SamplingParams) for p in params)):
            raise TypeError(f"params must be a SamplingParams or a sequence of them, got {type(params).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int (any: taken modulo 2**63), got {type(seed).__name__} {seed!r}")
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if not prompts:
            raise ValueError("prompts must hold at least one prompt")
        if len(params) != len(prompts):
            raise ValueError(f"params must be one SamplingParams or one per prompt; got {len(params)} for {len(prompts)} prompts")
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; step() the queued requests first")
        self.timings = Timings()
        try:
            requests = [self.add_request(prompt, p, (seed * 1_000_003 + i) % (1 << 63), name=f"prompts[{i}]")
                        for i, (prompt, p) in enumerate(zip(prompts, params))]
            while self.has_unfinished():  # true while a step is in flight: ends drained
                self.step()
                if on_step is not None:
                    on_step()
        finally:
            # After an error a decode step may still be in flight: drop it (freeing the
            # blocks it writes is safe, see _finish).
            self._inflight = None
            self.scheduler.clear()
            if self._sync is not None:
                self._sync.clear()
        return requests, self.timings
