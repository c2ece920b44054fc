"""DiffLlama-architecture decoder on the ``compiled_attn`` layers.

Llama (RMSNorm, RoPE, SwiGLU MLP, pre-norm residual blocks) with
:class:`~compiled_attn.layers.DifferentialAttention` in every layer, as Hugging Face
``DiffLlamaForCausalLM``; ``differential=False`` builds the same network with the plain
:class:`~compiled_attn.layers.Attention` layer (a plain Llama of the same projection
shapes, the baseline of the DIFF Transformer paper's comparisons, arXiv 2410.05258 §3).
Module names match that implementation except for two fused
projections per layer, ``self_attn.qkv_proj`` (``q_proj``, ``k_proj``, ``v_proj``) and
``mlp.gate_up_proj`` (``gate_proj``, ``up_proj``), one GEMM each as in vLLM; the loader
fuses a checkpoint's tensors and permutes its head order (see
:mod:`compiled_attn.models.loader`).

The forward takes packed tokens of a whole batch (``[T]``) with an
:class:`~compiled_attn.metadata.AttentionMetadata` and the paged KV cache, which makes it
one graph for ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import TensorParallel, all_gather
from ..layers import Attention, DifferentialAttention, RMSNorm, linear
from ..layers.linear import row_parallel_linear
from ..metadata import AttentionMetadata
from .config import DiffLlamaConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` (Shazeer, arXiv 2002.05202).

    ``gate`` and ``up`` are one GEMM, ``gate_up_proj`` (weight ``[2 * intermediate_size,
    hidden_size]``, gate rows first; vLLM ``MergedColumnParallelLinear``); ``down_proj``
    is ``[hidden_size, intermediate_size]``. No biases. Input and output ``[T, hidden_size]``;
    the block's RMSNorm before it and the residual add after it are fused into the GEMMs
    (:func:`compiled_attn.layers.linear`). ``tp``: set on a tensor-parallel shard (see
    :mod:`compiled_attn.models.sharding`), whose ``down_proj`` output is all-reduced.
    """

    tp: TensorParallel | None = None

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, input_norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual + mlp(input_norm(x))`` (norm and residual optional)."""
        hidden = linear(x, self.gate_up_proj, input_norm, silu_and_mul=True)
        return row_parallel_linear(hidden, self.down_proj, residual, self.tp)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; each norm runs
    inside the projection that follows it and each add inside the one before it.
    ``differential=False``: plain :class:`Attention` with the same heads (the config's
    ``lambda_*`` and ``subln_affine`` fields are then unused)."""

    def __init__(self, config: DiffLlamaConfig, layer_idx: int, differential: bool = True) -> None:
        super().__init__()
        common = dict(rope_theta=config.rope_theta, bias=config.attention_bias,
                      sliding_window=config.sliding_window, shares_kv_cache=layer_idx in config.kv_sharing)
        heads = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        if differential:
            self.self_attn = DifferentialAttention(
                *heads, depth=layer_idx, lambda_init=config.lambda_init, lambda_std=config.lambda_std_dev,
                subln_affine=config.subln_affine, norm_eps=config.rms_norm_eps, **common,
            )
        else:
            self.self_attn = Attention(*heads, **common)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, md: AttentionMetadata, kv_cache) -> torch.Tensor:
        x = self.self_attn(x, md, kv_cache, input_norm=self.input_layernorm, residual=x)
        return self.mlp(x, input_norm=self.post_attention_layernorm, residual=x)


class DiffLlamaModel(nn.Module):
    """Embedding, decoder layers and final norm, under Hugging Face's parameter names
    (``model.embed_tokens``, ``model.layers.N``, ``model.norm``). It holds them; the forward
    is :meth:`DiffLlamaForCausalLM.forward` (one hop less from a step to the kernels), which
    fuses the final norm into the LM head."""

    def __init__(self, config: DiffLlamaConfig, differential: bool = True) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, differential) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        owners = [i for i in range(config.num_hidden_layers) if i not in config.kv_sharing]
        # Index into the KV cache list of the cache each layer writes or reads.
        self.cache_index = [owners.index(config.kv_sharing.get(i, i)) for i in range(config.num_hidden_layers)]
        self.num_cache_layers = len(owners)


class DiffLlamaForCausalLM(nn.Module):
    """DiffLlama language model over packed, paged batches.

    Args:
        config: the model's :class:`DiffLlamaConfig`.
        differential: differential attention in every layer (DiffLlama); ``False`` builds
            a plain Llama with :class:`~compiled_attn.layers.Attention` and the same
            projection shapes (no ``lambda_*``, no ``subln``): the baseline for comparisons.
            Only differential models have a Hugging Face DiffLlama checkpoint format.

    ``num_cache_layers`` cache pairs of shape ``[num_blocks, block_size,
    num_key_value_heads, head_dim]`` serve it (layers with ``kv_sharing`` read another
    layer's pair).

    ``tp``: ``None``, or on a tensor-parallel shard (:func:`compiled_attn.models.sharding.shard_model`)
    its group: ``lm_head`` then holds this rank's vocabulary rows and the logits are gathered.
    """

    tp: TensorParallel | None = None

    def __init__(self, config: DiffLlamaConfig, differential: bool = True) -> None:
        super().__init__()
        if not isinstance(differential, bool):
            raise TypeError(f"differential must be a bool, got {differential!r} ({type(differential).__name__})")
        self.config = config
        self.differential = differential
        self.model = DiffLlamaModel(config, differential)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_cache_layers(self) -> int:
        return self.model.num_cache_layers

    def forward(self, md: AttentionMetadata, kv_caches: KVCaches | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Run one step and return float32 logits.

        Args:
            md: the batch (``md.input_ids`` ``[T]``).
            kv_caches: ``num_cache_layers`` ``(key_cache, value_cache)`` pairs, written in
                place; ``None`` runs every layer as a cache-less varlen attention (models
                without ``kv_sharing`` only).
            all_logits: logits of every token ``[T, vocab]`` instead of each sequence's
                last token ``[B, vocab]``.

        Raises:
            ValueError: ``kv_caches=None`` with ``kv_sharing`` layers.
        """
        model = self.model
        if kv_caches is None and model.num_cache_layers < len(model.layers):
            raise ValueError(
                "kv_caches=None is not supported with kv_sharing: a sharing layer reads its "
                "target layer's paged cache; pass kv_caches"
            )
        hidden = model.embed_tokens(md.input_ids)
        for layer, index in zip(model.layers, model.cache_index):
            hidden = layer(hidden, md, None if kv_caches is None else kv_caches[index])
        if not all_logits:
            hidden = hidden[md.last_token_indices()]  # the norm is per row: select first
        logits = linear(hidden, self.lm_head, model.norm)
        if self.tp is not None:
            logits = all_gather(logits, self.tp)  # [rows, vocab / tp] -> [rows, vocab]
        return logits.float()


def build_random_model(config: DiffLlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu", differential: bool = True) -> DiffLlamaForCausalLM:
    """A model with weights drawn from ``seed``: normal(0, 0.02) for matrices and
    embeddings (as Llama's ``initializer_range``), normal(0, ``lambda_std_dev``) for the
    lambda vectors, ones for norms. Same seed, same weights, on every machine.
    ``differential=False``: the plain-attention model (see :class:`DiffLlamaForCausalLM`).
    Returned in eval mode with gradients off."""
    generator = torch.Generator().manual_seed(seed)
    model = DiffLlamaForCausalLM(config, differential)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif ".lambda_" in name:
                param.normal_(0.0, config.lambda_std_dev, generator=generator)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
