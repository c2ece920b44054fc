"""Configuration of the DiffLlama-architecture decoder.

Field names follow Hugging Face ``DiffLlamaConfig`` so a checkpoint's ``config.json``
maps one to one; the extra fields (``sliding_window``, ``subln_affine``,
``kv_sharing``, ``lambda_init``) cover the other differential models the seed served
(SambaY / Phi-4-mini-flash style cross-layer KV sharing, affine ``subln``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..ops.validation import check_heads


@dataclass
class DiffLlamaConfig:
    """Hyper-parameters of :class:`compiled_attn.models.DiffLlamaForCausalLM`.

    Attributes:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers,
        num_attention_heads (single heads; ``num_attention_heads // 2`` pairs),
        num_key_value_heads, head_dim, rms_norm_eps, rope_theta, max_position_embeddings,
        tie_word_embeddings, attention_bias, bos_token_id, eos_token_id, lambda_std_dev:
            as Hugging Face ``DiffLlamaConfig``.
        sliding_window: per-layer attention window in tokens, or ``None``.
        subln_affine: the per-head RMSNorm has a weight.
        kv_sharing: ``{layer: target_layer}``; ``layer`` projects only Q and reads
            ``target_layer``'s cache (``target_layer < layer``, itself cache-owning).
        lambda_init: one value for all layers instead of the depth schedule.
    """

    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_hidden_layers: int = 16
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    lambda_std_dev: float = 0.1
    sliding_window: int | None = None
    subln_affine: bool = False
    kv_sharing: dict[int, int] = field(default_factory=dict)
    lambda_init: float | None = None

    def __post_init__(self) -> None:
        """Fill defaults; raise ValueError for head counts a differential layer can't
        use and for a bad ``kv_sharing`` map."""
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        check_heads(self.num_attention_heads, self.num_key_value_heads, differential=True)
        self.kv_sharing = {int(k): int(v) for k, v in self.kv_sharing.items()}
        for layer, target in self.kv_sharing.items():
            if not 0 <= target < layer < self.num_hidden_layers or target in self.kv_sharing:
                raise ValueError(
                    f"kv_sharing maps layer {layer} to {target}; the target must be an earlier, "
                    f"cache-owning layer and both must lie in [0, {self.num_hidden_layers})"
                )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.eos_token_id
        return frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> "DiffLlamaConfig":
        """Read a Hugging Face ``config.json`` dict.

        Raises:
            ValueError: not a DiffLlama config, or options this implementation lacks
                (non-default RoPE scaling, an activation other than SiLU, attention dropout).
        """
        if config.get("model_type") != "diffllama":
            raise ValueError(
                f"config.json has model_type={config.get('model_type')!r}; only 'diffllama' "
                "checkpoints are supported"
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default')")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
        if config.get("attention_dropout", 0.0):
            raise ValueError("attention_dropout > 0 is not supported for inference")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.items() if k in names}
        values["rope_theta"] = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        return cls(**values)


def default_config() -> DiffLlamaConfig:
    """The small embedded model of ``compiled-attn generate`` (byte-level vocabulary).

    4 layers, hidden 256, 8 heads of 32 (4 differential pairs), 4 KV heads (GQA 2),
    SwiGLU width 688, 256 byte tokens, no EOS (generation stops at max_new_tokens),
    untied output head, weights drawn from a seeded generator (about 3.0 M parameters).
    """
    return DiffLlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    )
