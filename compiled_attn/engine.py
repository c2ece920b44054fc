"""The decode loop: one varlen prefill of all prompts, then batched decode steps over
the paged KV cache, sequences leaving the batch as they finish."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .compile import CompiledForward, CompileStats
from .kv_cache import KVCache
from .metadata import SequenceChunk, build_metadata
from .sampling import SamplingParams, sample


@dataclass
class Completion:
    """One request's result.

    Attributes:
        prompt_ids: the prompt token ids.
        output_ids: generated token ids (EOS included when it ended the sequence).
        finish_reason: ``"length"`` (max_new_tokens) or ``"eos"``.
    """

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Timings:
    """Wall times (seconds) and token counts of one :meth:`Engine.generate` call."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Engine:
    """Runs a causal LM over a paged KV cache.

    Args:
        model: a :class:`~compiled_attn.models.DiffLlamaForCausalLM` (or any module with
            the same ``forward(md, kv_caches, all_logits)`` and ``config``/
            ``num_cache_layers``), already on its device and dtype.
        max_model_len: longest sequence (prompt + output) in tokens; default the model's
            ``max_position_embeddings``.
        block_size: tokens per cache block.
        num_blocks: cache blocks; default enough for 8 sequences of ``max_model_len``.
        compile: run the forward through :class:`~compiled_attn.compile.CompiledForward`.
        compile_kwargs: extra ``torch.compile`` arguments.

    Raises:
        ValueError: bad sizes.
    """

    def __init__(self, model: torch.nn.Module, *, max_model_len: int | None = None,
                 block_size: int = 16, num_blocks: int | None = None, compile: bool = True,
                 compile_kwargs: dict | None = None) -> None:
        config = model.config
        param = next(model.parameters())
        self.model, self.device, self.dtype = model, param.device, param.dtype
        self.max_model_len = max_model_len or config.max_position_embeddings
        if self.max_model_len < 1 or block_size < 1:
            raise ValueError(f"max_model_len and block_size must be >= 1, got {self.max_model_len}, {block_size}")
        self.max_blocks_per_seq = -(-self.max_model_len // block_size)
        num_blocks = num_blocks or 8 * self.max_blocks_per_seq
        self.kv_cache = KVCache.allocate(
            model.num_cache_layers, num_blocks, block_size, config.num_key_value_heads,
            config.head_dim, self.dtype, self.device,
        )
        self.eos_token_ids = config.eos_token_ids
        self.forward = CompiledForward(model, **(compile_kwargs or {})) if compile else model
        self._next_seq_id = 0

    @property
    def compile_stats(self) -> CompileStats | None:
        return getattr(self.forward, "stats", None)

    def _step(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        md = build_metadata(chunks, self.kv_cache.block_size, self.max_blocks_per_seq, self.device,
                            self.kv_cache.allocator.num_blocks)
        with torch.inference_mode():
            return self.forward(md, self.kv_cache.layers)

    def _validate(self, prompts: Sequence[Sequence[int]], params: list[SamplingParams]) -> None:
        vocab = self.model.config.vocab_size
        if not prompts:
            raise ValueError("prompts must hold at least one prompt")
        if len(params) != len(prompts):
            raise ValueError(f"params must be one SamplingParams or one per prompt; got {len(params)} for {len(prompts)} prompts")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}] is empty; every prompt needs >= 1 token")
            if any(not 0 <= t < vocab for t in prompt):
                raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab})")
            if len(prompt) + p.max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"prompts[{i}] has {len(prompt)} tokens; with max_new_tokens="
                    f"{p.max_new_tokens} it exceeds max_model_len={self.max_model_len}"
                )

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 seed: int = 0) -> tuple[list[Completion], Timings]:
        """Generate a completion for every prompt.

        All prompts are prefilled in one varlen batch; then every unfinished sequence
        advances one token per decode step. A sequence stops at ``max_new_tokens`` or an
        EOS token and frees its blocks while the others go on.

        Args:
            prompts: token id lists, each non-empty.
            params: sampling parameters, one for all prompts or one per prompt.
            seed: seeds the sampling generator (same seed, same tokens).

        Returns:
            The completions (in prompt order) and the timings.

        Raises:
            ValueError: empty or out-of-vocabulary prompts, too long for max_model_len.
            compiled_attn.kv_cache.OutOfBlocksError: the cache is too small for the batch.
        """
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        self._validate(prompts, params)
        allocator = self.kv_cache.allocator
        generator = torch.Generator(self.device).manual_seed(seed)
        completions = [Completion(list(p)) for p in prompts]
        seq_ids = list(range(self._next_seq_id, self._next_seq_id + len(prompts)))
        self._next_seq_id += len(prompts)
        timings = Timings(prefill_tokens=sum(len(p) for p in prompts))
        try:
            chunks = [SequenceChunk(p, 0, allocator.allocate(s, len(p))) for s, p in zip(seq_ids, prompts)]
            active = list(range(len(prompts)))
            start = time.perf_counter()
            tokens = self._sample(self._step(chunks), [params[i] for i in active], generator)
            timings.prefill_seconds = time.perf_counter() - start
            start = time.perf_counter()
            while True:
                active = [i for i, t in zip(active, tokens) if not self._append(completions[i], t, params[i])]
                for i, c in enumerate(completions):
                    if c.finish_reason is not None:
                        allocator.free(seq_ids[i])
                if not active:
                    break
                chunks = []
                for i in active:
                    c = completions[i]
                    position = len(c.prompt_ids) + len(c.output_ids) - 1
                    table = allocator.allocate(seq_ids[i], position + 1)
                    chunks.append(SequenceChunk([c.output_ids[-1]], position, table))
                tokens = self._sample(self._step(chunks), [params[i] for i in active], generator)
                timings.decode_tokens += len(active)
            timings.decode_seconds = time.perf_counter() - start
        finally:
            for s in seq_ids:
                allocator.free(s)
        return completions, timings

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generator: torch.Generator) -> list[int]:
        temperature = torch.tensor([p.temperature for p in params], device=self.device)
        top_p = torch.tensor([p.top_p for p in params], device=self.device)
        return sample(logits, temperature, top_p, generator).tolist()

    def _append(self, completion: Completion, token: int, params: SamplingParams) -> bool:
        """Add ``token``; returns True when the sequence is finished."""
        completion.output_ids.append(token)
        if token in self.eos_token_ids:
            completion.finish_reason = "eos"
        elif len(completion.output_ids) >= params.max_new_tokens:
            completion.finish_reason = "length"
        return completion.finish_reason is not None
