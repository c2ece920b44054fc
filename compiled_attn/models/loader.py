"""Load a Hugging Face DiffLlama directory (``config.json`` + safetensors).

Hugging Face's DiffLlama stores the two components of a head pair in *block halves*:
component 1 of pair ``j`` is query head ``j`` and component 2 is head ``j + H/2`` (KV
heads likewise with ``Hkv/2``); see ``DiffLlamaAttention.forward`` (``torch.chunk`` over
heads). Our layers and cache use *interleaved* pairs (heads ``2j``, ``2j + 1``), so the
rows of ``q_proj``, ``k_proj`` and ``v_proj`` are permuted once here, at load time. The
output of pair ``j`` stays at position ``j``, so ``o_proj`` is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from einops import rearrange
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import DiffLlamaConfig
from .diffllama import DiffLlamaForCausalLM


def halves_to_interleaved(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder the head rows of a projection from block halves to interleaved pairs.

    Args:
        weight: ``[num_heads * head_dim, ...]`` (a weight matrix or a bias).
        num_heads: heads in the rows (even).
    """
    return rearrange(weight, "(two h d) ... -> (h two d) ...", two=2, h=num_heads // 2)


def interleaved_to_halves(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of :func:`halves_to_interleaved` (to write a Hugging Face checkpoint)."""
    return rearrange(weight, "(h two d) ... -> (two h d) ...", two=2, h=num_heads // 2)


def projection_heads(name: str, config: DiffLlamaConfig) -> int | None:
    """Heads in the rows of tensor ``name`` when it is a Q/K/V projection weight or bias
    (the tensors whose head order differs between layouts), else ``None``."""
    parts = name.split(".")
    proj = parts[-2] if len(parts) >= 2 else ""
    if proj == "q_proj":
        return config.num_attention_heads
    if proj in ("k_proj", "v_proj"):
        return config.num_key_value_heads
    return None


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).exists()]
        if missing:
            raise FileNotFoundError(f"model directory {model_dir} lacks shards listed in {index.name}: {missing}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(
            f"model directory {model_dir} has no model.safetensors or model.safetensors.index.json"
        )
    return [single]


def load_config(model_dir: str | Path) -> DiffLlamaConfig:
    """Read ``model_dir/config.json``.

    Raises:
        FileNotFoundError: no directory or no ``config.json``.
        ValueError: not a DiffLlama config (see :meth:`DiffLlamaConfig.from_hf_dict`).
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model directory {model_dir} has no config.json")
    config = DiffLlamaConfig.from_hf_dict(_read_json(path))
    generation = Path(model_dir) / "generation_config.json"  # transformers' generate reads EOS here
    if generation.is_file() and "eos_token_id" in (values := _read_json(generation)):
        config.eos_token_id = values["eos_token_id"]
    return config


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def load_diffllama(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> DiffLlamaForCausalLM:
    """Build a :class:`DiffLlamaForCausalLM` from a Hugging Face DiffLlama directory.

    Args:
        model_dir: directory with ``config.json`` and ``model.safetensors`` (or a sharded
            index).
        dtype: parameter dtype (float32, float16, bfloat16).
        device: where the model goes.

    Returns:
        The model in eval mode with gradients off.

    Raises:
        FileNotFoundError: missing config or weight files.
        ValueError: not a DiffLlama, unreadable JSON or safetensors, or tensors missing /
            unexpected / of the wrong shape.
    """
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    state = {}
    for path in _weight_files(model_dir):
        try:
            state.update(load_file(path))
        except SafetensorError as err:
            raise ValueError(f"{path} is not a readable safetensors file: {err}") from None
    for key in list(state):
        heads = projection_heads(key, config)
        if heads is not None:
            state[key] = halves_to_interleaved(state[key], heads)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = DiffLlamaForCausalLM(config)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"weights in {model_dir} do not match a DiffLlama of this config: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches
        raise ValueError(f"weights in {model_dir} do not fit the config: {err}") from err
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
