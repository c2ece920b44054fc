"""What runs in the next engine step: admission, token budget, chunked prefill, preemption.

No tensors here (nano-vllm's split: this scheduler, the model runner of
:mod:`compiled_attn.model_runner`, the loop of :mod:`compiled_attn.engine`).

Every request, at every moment, has computed (written the K/V of) its first
``num_computed`` tokens; the rest are pending. A step computes a *chunk* of each scheduled
request's pending tokens, and samples a token for the requests whose chunk reaches their
last token. A fresh prompt is all pending; a decoding request has one pending token (the
last sampled one); a request preempted and re-admitted recomputes prompt and output so far
(vLLM's recompute preemption), its cached prefix aside.

:meth:`Scheduler.schedule` takes the running requests first, oldest first, then admits
waiting ones (first come, first served), within ``max_num_seqs`` requests and
``max_num_batched_tokens`` tokens a step (vLLM's chunked prefill: a prompt longer than what is
left of the budget runs in chunks over several steps, beside the decode rows). A request
with ``n > 1`` samples takes ``n`` running slots; its prompt is computed once, then forked
into ``n`` sequences that share its blocks, a shared block being copied when one of them
first writes it (copy-on-write). Blocks are allocated as sequences grow; when the cache runs out for a running request, the newest
running request is preempted (its blocks freed; its full blocks stay in the prefix cache)
and goes back to the front of the queue. No request is lost, and the tokens equal those of
an engine with room to spare.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from .block_allocator import BlockAllocator, OutOfBlocksError
from .ops.arith import cdiv
from .sampling import SamplingParams, sample_seed
from .step_inputs import DecodeRow


@dataclass(eq=False)  # compared by identity (`in running`, `remove`): field equality walked the prompts
class Request:
    """One generation request and its result so far.

    Attributes:
        request_id: engine-wide id (also its sequence id in the block allocator).
        prompt_ids: the prompt token ids.
        params: its sampling parameters.
        seed: the seed its random draws are keyed by.
        output_ids: generated token ids (EOS included when it ended the sequence).
        finish_reason: ``None`` while running, then ``"length"`` or ``"eos"``.
        num_computed: tokens whose K/V are in the cache.
        num_cached: prompt tokens found in the prefix cache at its (last) admission.
        num_preemptions: times it was preempted.
        samples: with ``params.n > 1``, the other ``n - 1`` completions of its prompt
            (requests forked from this one when its prompt was computed), else empty.
    """

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_computed: int = 0
    num_cached: int = 0
    num_preemptions: int = 0
    samples: list["Request"] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def decoding(self) -> bool:
        """All its tokens but the last sampled one are computed."""
        return bool(self.output_ids) and self.num_computed == self.num_tokens - 1

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids ``start .. end - 1`` of prompt + output."""
        prompt = len(self.prompt_ids)
        return self.prompt_ids[start:end] + self.output_ids[max(start - prompt, 0):max(end - prompt, 0)]

    def decode_row(self, block_table: Sequence[int]) -> DecodeRow:
        return DecodeRow(self.output_ids[-1], self.num_tokens - 1, block_table,
                         self.params.temperature, self.params.top_p, self.seed)


@dataclass
class Step:
    """One step's work: ``chunks``, and ``copies``, the ``(src, dst)`` block copies to make
    before it (copy-on-write of blocks shared by parallel samples)."""

    chunks: list["Chunk"]
    copies: list[tuple[int, int]]


@dataclass(frozen=True)
class Chunk:
    """``num_tokens`` pending tokens of ``request`` that a step computes, from
    ``request.num_computed`` on."""

    request: Request
    num_tokens: int

    @property
    def completes(self) -> bool:
        """It reaches the request's last token: the step samples the request's next token."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


def check_token_budget(max_num_batched_tokens: int | None, max_num_seqs: int, block_size: int,
                       names: tuple[str, str, str] = ("max_num_batched_tokens", "max_num_seqs", "block_size")) -> None:
    """Check a step's token budget: ``None`` (no limit) or an int at least ``block_size``
    (the first chunk of a prompt fills a block) and ``max_num_seqs`` (a token for each
    running request; vLLM's rule). ``names``: what the three are called in the message (the
    CLI passes its flags).

    Raises:
        TypeError: ``max_num_batched_tokens`` neither ``None`` nor an int.
        ValueError: an int below either bound.
    """
    budget, seqs, block = names
    if max_num_batched_tokens is None:
        return
    if isinstance(max_num_batched_tokens, bool) or not isinstance(max_num_batched_tokens, int):
        raise TypeError(f"{budget} must be None or an int, got {type(max_num_batched_tokens).__name__} "
                        f"{max_num_batched_tokens!r}")
    if max_num_batched_tokens < max(block_size, max_num_seqs):
        raise ValueError(f"{budget} must be >= {block} ({block_size}) and >= {seqs} ({max_num_seqs}, a token "
                         f"for each running request), got {max_num_batched_tokens}")


class Scheduler:
    """Queues requests and decides each step's chunks.

    Args:
        allocator: the KV cache's block allocator (prefix caching is its setting).
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens computed in one step, at least ``max_num_seqs``
            (a token for each running request; ``None``: no limit, so every prompt is
            prefilled whole).
        max_model_len: longest sequence (blocks are never allocated past it).

    Raises:
        TypeError, ValueError: a bad ``max_num_batched_tokens`` (:func:`check_token_budget`).
    """

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int | None,
                 max_model_len: int) -> None:
        check_token_budget(max_num_batched_tokens, max_num_seqs, allocator.block_size)
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._copies: list[tuple[int, int]] = []  # the step being scheduled's block copies

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        """The next step (no chunks when nothing can run); allocates their blocks (copying a
        shared block a chunk writes), preempting as needed, and admits waiting requests."""
        budget = self.max_num_batched_tokens or float("inf")
        chunks: list[Chunk] = []
        self._copies = []
        preempted = False
        for request in list(self.running):
            if request not in self.running:  # preempted by an older request of this step
                continue
            count = min(request.num_tokens - request.num_computed, budget)
            if count <= 0:
                continue
            while not self._fits(request, count):
                preempted = True
                victim = self.running[-1]
                self.preempt(victim)
                if victim is request:
                    break
            else:
                chunks.append(Chunk(request, count))
                budget -= count
        while self.waiting and not preempted and budget > 0 and self._has_slot(self.waiting[0]):
            request = self.waiting[0]
            request.num_computed = request.num_cached = self.allocator.allocate_prefix(
                request.request_id, request.token_ids(0, request.num_tokens))
            count = min(request.num_tokens - request.num_computed, budget)
            if not self._fits(request, count):
                self.allocator.free(request.request_id)
                request.num_computed = request.num_cached = 0
                break
            self.running.append(self.waiting.popleft())
            chunks.append(Chunk(request, count))
            budget -= count
        return Step(chunks, self._copies)

    def _slots(self) -> int:
        """Running slots taken (``max_num_seqs`` bounds them)."""
        return sum(self._rows(r) for r in self.running)

    def _has_slot(self, request: Request) -> bool:
        """Whether the waiting ``request`` (its samples included) fits beside the running ones."""
        return self._slots() + self._rows(request) <= self.max_num_seqs

    @staticmethod
    def _rows(request: Request) -> int:
        """Running slots ``request`` takes once admitted: its ``n`` samples before they fork."""
        return request.params.n if request.num_tokens == len(request.prompt_ids) and not request.samples else 1

    def can_admit(self, reserved_blocks: int = 0) -> bool:
        """Whether a waiting request would be admitted now (ignoring the prefix cache): a
        running slot (the budget, at least ``max_num_seqs``, then has a token left after one
        for each running request), and the blocks of its first chunk among the free ones
        but ``reserved_blocks`` (set aside for the running requests' growth)."""
        if not self.waiting or not self._has_slot(self.waiting[0]):
            return False
        request = self.waiting[0]
        count = min(request.num_tokens, self.max_num_batched_tokens or request.num_tokens)
        return self.allocator.blocks_needed(request.request_id, self._tokens_to_hold(request, count)) \
            <= self.allocator.num_free_blocks - reserved_blocks

    def _tokens_to_hold(self, request: Request, count: int) -> int:
        """Tokens ``request`` must have room for after computing ``count`` more: those, and
        the next position when the chunk completes (the decode step's on-device advance
        addresses it)."""
        end = request.num_computed + count
        return min(end + (end == request.num_tokens), self.max_model_len)

    def _fits(self, request: Request, count: int) -> bool:
        """Allocate what computing ``count`` more tokens of ``request`` needs, a private copy
        of a shared block it writes included; False when the cache has no room."""
        try:
            self.allocator.allocate(request.request_id, self._tokens_to_hold(request, count))
            copy = self.allocator.copy_on_write(request.request_id, request.num_computed)
        except OutOfBlocksError:
            return False
        if copy is not None:
            self._copies.append(copy)
        return True

    def preempt(self, request: Request) -> None:
        """Free ``request``'s blocks and queue it first, to recompute what it has."""
        self.running.remove(request)
        self.allocator.free(request.request_id)
        request.num_computed = request.num_cached = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def blocks_reserved(self, prompt_len: int, max_new_tokens: int) -> int:
        """Blocks a request holds at most: prompt + max_new_tokens (+1 for the advance), within
        ``max_model_len``."""
        return cdiv(min(prompt_len + max_new_tokens + 1, self.max_model_len), self.allocator.block_size)

    def next_decode_blocks(self) -> int:
        """Blocks the running requests still need to hold ``num_tokens + 2`` tokens (within
        ``max_model_len``): the token of a decode step in flight, the one the next step
        samples, and the slot a decode step's advance addresses after it."""
        return sum(self.allocator.blocks_needed(r.request_id, min(r.num_tokens + 2, self.max_model_len))
                   for r in self.running)

    def allocate_decode(self, ahead: int) -> list[list[int]]:
        """Blocks for a decode step over the running requests, returned as their block tables:
        room for ``ahead`` tokens in flight (0 or 1), this step's and the slot the step's
        advance addresses after it, within ``max_model_len`` (a step in flight never runs
        past ``max_new_tokens``).

        Raises:
            OutOfBlocksError: the cache lacks them (the engine checks first, see
                :meth:`next_decode_blocks`)."""
        return [self.allocator.allocate(r.request_id, min(r.num_tokens + ahead + 1, self.max_model_len))
                for r in self.running]

    def sample_requests(self, parent: Request) -> list[Request]:
        """The ``n - 1`` other samples of ``parent`` (parallel sampling), made when its prompt
        completes and before it has an output: ids ``parent.request_id + k`` (reserved when
        it was added), seeds :func:`~compiled_attn.sampling.sample_seed` ``(seed, k)``. They
        join :attr:`running` through :meth:`fork`, each once its first token is drawn."""
        params = dataclasses.replace(parent.params, n=1, seed=None)
        parent.samples = [Request(parent.request_id + k, parent.prompt_ids, params, sample_seed(parent.seed, k))
                          for k in range(1, parent.params.n)]
        return parent.samples

    def computed(self, request: Request, count: int) -> None:
        """``count`` more tokens of ``request`` are in the cache; full blocks among them
        enter the prefix cache."""
        request.num_computed += count
        if request.num_computed // self.allocator.block_size > self.allocator.num_hashed(request.request_id):
            self.allocator.cache_full_blocks(request.request_id, request.token_ids(0, request.num_computed),
                                             request.num_computed)

    def fork(self, parent: Request, child: Request) -> None:
        """Run ``child`` beside ``parent`` from here on, sharing its blocks (see
        :meth:`BlockAllocator.fork`) and its computed tokens."""
        self.allocator.fork(parent.request_id, child.request_id)
        child.num_computed = parent.num_computed
        self.running.append(child)

    def finish(self, request: Request) -> None:
        """Take a finished request out and free its blocks."""
        self.running.remove(request)
        self.allocator.free(request.request_id)

    def clear(self) -> None:
        """Drop every request (their blocks freed)."""
        for request in [*self.waiting, *self.running]:
            self.allocator.free(request.request_id)
        self.waiting.clear()
        self.running.clear()
