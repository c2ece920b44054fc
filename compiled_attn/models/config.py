"""Configuration of the DiffLlama-architecture decoder.

Field names follow Hugging Face ``DiffLlamaConfig`` so a checkpoint's ``config.json``
maps one to one; the extra fields (``sliding_window``, ``subln_affine``,
``kv_sharing``, ``lambda_init``) cover the other differential models the seed served
(SambaY / Phi-4-mini-flash style cross-layer KV sharing, affine ``subln``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..ops.validation import check_head_size, check_heads


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
    bos_token_id: int | list[int] | None = 1
    eos_token_id: int | list[int] | None = 2
    lambda_std_dev: float = 0.1
    sliding_window: int | None = None
    subln_affine: bool = False
    kv_sharing: dict[int, int] = field(default_factory=dict)
    lambda_init: float | None = None

    def __post_init__(self) -> None:
        """Check every field (see :func:`_validate_fields`) and fill defaults.

        Raises:
            ValueError: a field of the wrong type or out of range, head counts or a head
                size a differential layer can't use, a bad ``kv_sharing`` map.
        """
        _validate_fields(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
            if self.head_dim < 1:
                raise ValueError(
                    f"head_dim is not given and hidden_size // num_attention_heads = "
                    f"{self.hidden_size} // {self.num_attention_heads} = 0; allowed: an int > 0"
                )
        check_heads(self.num_attention_heads, self.num_key_value_heads, differential=True)
        check_head_size("head_dim", self.head_dim)
        self.kv_sharing = {int(k): v for k, v in self.kv_sharing.items()}
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

        Keys this implementation does not read (``initializer_range``, ``torch_dtype``, ...)
        are ignored; every key it reads is checked (see :func:`_validate_hf_options` and
        :func:`_validate_fields`) before anything is built.

        Raises:
            ValueError: not a DiffLlama config; options this implementation lacks (RoPE
                scaling, an activation other than SiLU, attention dropout); a field of the
                wrong type or out of range (the message names the field, the value given
                and what is allowed).
        """
        rope_theta = _validate_hf_options(config)
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.items() if k in names}
        values["rope_theta"] = rope_theta
        return cls(**values)


# Checks of every field, in one place. Each failure is a ValueError naming the field, the
# value given and what is allowed, raised before any tensor is allocated.

_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")  # None: derived from the others
_BOOLS = ("tie_word_embeddings", "attention_bias", "subln_affine")
_TOKEN_IDS = ("bos_token_id", "eos_token_id")
_SUPPORTED_ROPE_TYPES = ("default",)


def _bad(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_float(name: str, value: Any, *, minimum: float | None = None, strict: bool = True) -> None:
    """``value`` is a finite int or float, ``> minimum`` (``>=`` when not ``strict``)."""
    if minimum is None:
        allowed = "a finite number"
        ok = True
    else:
        allowed = f"a finite number {'>' if strict else '>='} {minimum:g}"
        ok = _is_number(value) and (value > minimum if strict else value >= minimum)
    if not (_is_number(value) and math.isfinite(value) and ok):
        raise _bad(name, value, allowed)


def _validate_fields(config: "DiffLlamaConfig") -> None:
    """Type and range of every field of ``config`` (before defaults are filled).

    Sizes are ints (not bools, strings or floats) > 0; ``rms_norm_eps`` and ``rope_theta``
    finite numbers > 0, ``lambda_std_dev`` >= 0, ``lambda_init`` finite or ``None``;
    ``tie_word_embeddings``, ``attention_bias``, ``subln_affine`` bools; token ids an int
    >= 0, a list of them or ``None``; ``sliding_window`` an int >= 1 or ``None``;
    ``kv_sharing`` a map from layer to layer (ints; keys may be decimal strings, as JSON
    writes them).

    Raises:
        ValueError: the first field that fails, with its value and what is allowed.
    """
    for name in _SIZES:
        value = getattr(config, name)
        if value is None and name in _OPTIONAL_SIZES:
            continue
        if not (_is_int(value) and value > 0):
            allowed = "an int > 0" + (" or null" if name in _OPTIONAL_SIZES else "")
            raise _bad(name, value, allowed)
    _check_float("rms_norm_eps", config.rms_norm_eps, minimum=0.0)
    _check_float("rope_theta", config.rope_theta, minimum=0.0)
    _check_float("lambda_std_dev", config.lambda_std_dev, minimum=0.0, strict=False)
    if config.lambda_init is not None:
        _check_float("lambda_init", config.lambda_init)
    for name in _BOOLS:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise _bad(name, value, "a bool (true or false)")
    for name in _TOKEN_IDS:
        value = getattr(config, name)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(_is_int(i) and i >= 0 for i in ids):
            raise _bad(name, value, "a token id (an int >= 0), a list of them, or null")
    window = config.sliding_window
    if window is not None and not (_is_int(window) and window >= 1):
        raise _bad("sliding_window", window, "an int >= 1 or null")
    sharing = config.kv_sharing
    if not isinstance(sharing, dict) or not all(
        (_is_int(k) or (isinstance(k, str) and k.isdecimal())) and _is_int(v) for k, v in sharing.items()
    ):
        raise _bad("kv_sharing", sharing, "a map from layer index to an earlier layer index (ints)")


def _validate_hf_options(config: dict[str, Any]) -> float:
    """The keys of a Hugging Face ``config.json`` that have no field of their own:
    ``model_type``, ``rope_parameters`` / ``rope_scaling``, ``hidden_act``,
    ``attention_dropout``. Returns the RoPE base (``rope_parameters.rope_theta``, else
    ``rope_theta``, else 10000), checked with the other fields.

    RoPE scaling is not implemented, so a ``rope_parameters`` or ``rope_scaling`` whose
    type is not ``'default'`` (or that names no type yet holds more than ``rope_theta``,
    such as a bare ``factor``) is refused, never ignored; both keys
    are checked, as transformers 5 writes ``rope_parameters`` and older versions
    ``rope_scaling``.

    Raises:
        ValueError: naming the key, the value given and what is allowed.
    """
    if config.get("model_type") != "diffllama":
        raise ValueError(
            f"model_type={config.get('model_type')!r} is not supported; only 'diffllama' "
            "checkpoints are"
        )
    rope_theta = config.get("rope_theta", 10000.0)
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise _bad(key, rope, "an object with a 'rope_type', or null")
        # No type named: plain RoPE only when nothing but its base is given.
        unscaled = "default" if rope.keys() <= {"rope_theta"} else None
        rope_type = rope.get("rope_type", rope.get("type", unscaled))
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"{key}: rope_type {rope_type!r} is not supported (only "
                f"{', '.join(map(repr, _SUPPORTED_ROPE_TYPES))}; RoPE scaling is not "
                f"implemented), got {key}={rope!r}"
            )
        if key == "rope_parameters" and "rope_theta" in rope:
            rope_theta = rope["rope_theta"]
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
    dropout = config.get("attention_dropout", 0.0)
    if dropout is not None and not (_is_number(dropout) and dropout == 0):
        raise ValueError(
            f"attention_dropout must be 0 (dropout > 0 is not supported for inference), "
            f"got {dropout!r} ({type(dropout).__name__})"
        )
    return rope_theta


def random_model_config() -> DiffLlamaConfig:
    """The seeded random model of ``compiled-attn generate --random-model`` (byte-level
    vocabulary; tests use it; the trained default is :data:`~compiled_attn.models.DEFAULT_MODEL_DIR`).

    4 layers, hidden 256, 8 heads of 32 (4 differential pairs), 4 KV heads (GQA 2),
    SwiGLU width 688, 256 byte tokens, no EOS (generation stops at max_new_tokens),
    untied output head, weights drawn from a seeded generator (about 3.0 M parameters).
    """
    return DiffLlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    )
