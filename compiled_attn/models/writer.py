"""Write a model as a Hugging Face DiffLlama directory (``config.json`` + ``model.safetensors``).

The inverse of :func:`compiled_attn.models.load_diffllama`: fused projections are split
back into ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``
(:func:`~compiled_attn.models.loader.unfuse_state_dict`), and the Q/K/V head rows go from
our interleaved pairs back to Hugging Face's block halves
(:func:`~compiled_attn.models.loader.interleaved_to_halves`). Files are written with the
``safetensors`` library, with the ``{"format": "pt"}`` metadata that
``transformers.PreTrainedModel.from_pretrained`` expects.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import DiffLlamaConfig
from .diffllama import DiffLlamaForCausalLM
from .loader import interleaved_to_halves, projection_heads, unfuse_state_dict

HF_ONLY_IN_OURS = ("sliding_window", "subln_affine", "kv_sharing", "lambda_init")
"""Config fields our loader reads that transformers' ``DiffLlamaConfig`` does not know: a
checkpoint that sets them away from their defaults loads in our loader only."""


def config_to_hf_dict(config: DiffLlamaConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` object of a DiffLlama of ``config``, as transformers 5 writes it.

    Every field :meth:`DiffLlamaConfig.from_hf_dict` reads is written, so
    ``DiffLlamaConfig.from_hf_dict(config_to_hf_dict(c)) == c``; the RoPE base goes both
    into ``rope_parameters`` (transformers 5) and ``rope_theta`` (transformers 4);
    ``kv_sharing`` keys become strings, as JSON requires. ``dtype`` is recorded as
    ``"dtype"`` (the dtype of the stored tensors).
    """
    values = dataclasses.asdict(config)
    values["kv_sharing"] = {str(k): v for k, v in config.kv_sharing.items()}
    return {
        "architectures": ["DiffLlamaForCausalLM"],
        "model_type": "diffllama",
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "pad_token_id": None,
        **values,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "dtype": str(dtype).removeprefix("torch."),
    }


def save_diffllama(model: DiffLlamaForCausalLM, directory: str | Path,
                   dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` as a Hugging Face DiffLlama checkpoint in ``directory``.

    Writes ``config.json`` (:func:`config_to_hf_dict`) and ``model.safetensors`` with
    Hugging Face names and layouts: ``q_proj`` ``[Hq * D, hidden]``, ``k_proj``/``v_proj``
    ``[Hkv * D, hidden]`` with heads in block halves (component 1 of every pair, then
    component 2), ``gate_proj``/``up_proj`` ``[intermediate, hidden]``, ``lambda_q1`` ...
    ``[D]``; no ``lm_head.weight`` when ``tie_word_embeddings`` (as ``save_pretrained``).
    Both :func:`~compiled_attn.models.load_diffllama` and transformers'
    ``DiffLlamaForCausalLM.from_pretrained`` read it back to the same logits; the fields in
    :data:`HF_ONLY_IN_OURS` (``sliding_window``, ``subln_affine`` weights, ``kv_sharing``,
    ``lambda_init``) are written too, but transformers' DiffLlama does not implement them,
    so only our loader reproduces a model that uses them.

    Args:
        model: a differential :class:`DiffLlamaForCausalLM` (any device; tensors are
            copied to the CPU).
        directory: created if absent (with parents); existing files of these names are
            replaced.
        dtype: cast floating-point tensors to this dtype (``torch.bfloat16`` halves the file
            of a float32 model); ``None`` keeps the model's dtype.

    Returns:
        ``directory`` as a :class:`~pathlib.Path`.

    Raises:
        TypeError: ``model`` is not a :class:`DiffLlamaForCausalLM`, or ``dtype`` is not a
            floating-point ``torch.dtype``.
        ValueError: ``model`` was built with ``differential=False`` (a plain Llama has no
            DiffLlama checkpoint), is a tensor-parallel shard (save the full model), or a
            weight holds NaN or infinity (the loader would refuse the file; the message
            names the tensor).
        FileExistsError: ``directory`` exists and is not a directory.
    """
    if not isinstance(model, DiffLlamaForCausalLM):
        raise TypeError(f"model must be a DiffLlamaForCausalLM, got {type(model).__name__}")
    if not model.differential:
        raise ValueError("model was built with differential=False; only differential models have a "
                         "Hugging Face DiffLlama checkpoint format (model)")
    if getattr(model, "tp_config", None) is not None:
        raise ValueError("model is a tensor-parallel shard (model.tp_config is set); save the full model")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"directory {directory} exists and is not a directory")
    config = model.config
    state = {}
    for name, tensor in unfuse_state_dict(model.state_dict(), config).items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # the same tensor as model.embed_tokens.weight
        heads = projection_heads(name, config)
        if heads is not None:
            tensor = interleaved_to_halves(tensor, heads)
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"tensor {name} holds NaN or infinity; the loader refuses non-finite weights")
        state[name] = tensor.contiguous()
    stored = dtype or next(model.parameters()).dtype
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    text = json.dumps(config_to_hf_dict(config, stored), indent=2, allow_nan=False)
    (directory / "config.json").write_text(text + "\n", encoding="utf-8")
    return directory


__all__ = ["HF_ONLY_IN_OURS", "config_to_hf_dict", "save_diffllama"]
