"""Checkpoints of a ``compiled-attn train`` run: writing ``checkpoints/step_NNNNNN/``
(float32 weights + ``trainer_state.pt``), reading one back to resume, and saving a model
(DiffLlama or plain) in a directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .models import DiffLlamaConfig, DiffLlamaForCausalLM, load_diffllama, save_diffllama
from .models.writer import config_to_hf_dict
from .train_config import TRAJECTORY_FIELDS, TrainConfig, settings_of

STATE_FILE = "trainer_state.pt"


def read_checkpoint(path: Path, config: TrainConfig) -> dict:
    """The ``trainer_state.pt`` of checkpoint directory ``path`` (step, optimizer state,
    settings, losses, validations), made with ``config``'s :data:`TRAJECTORY_FIELDS`.

    Raises:
        ValueError: ``path`` has no readable state file, was made with other trajectory
            settings, or its step is outside ``(0, config.steps]``.
    """
    state_path = Path(path) / STATE_FILE
    if not state_path.is_file():
        raise ValueError(f"resume: {path} is not a checkpoint directory (no {STATE_FILE})")
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises several types for a bad file
        raise ValueError(f"resume: {state_path} is not readable: {err}") from None
    ours, theirs = settings_of(config), state["settings"]
    differ = _differences({n: ours[n] for n in TRAJECTORY_FIELDS}, {n: theirs.get(n) for n in TRAJECTORY_FIELDS})
    if differ:
        raise ValueError(f"resume: checkpoint {path} was made with other settings: {', '.join(differ)}")
    if not 0 < state["step"] <= config.steps:
        raise ValueError(f"resume: checkpoint step {state['step']} is outside (0, steps={config.steps}]")
    return state


def _differences(ours: dict, theirs: dict, prefix: str = "") -> list[str]:
    """``name=theirs (now ours)`` for each differing entry, nested dicts (the model config)
    entry by entry (``model.hidden_size=64 (now 128)``)."""
    out = []
    for name in ours:
        mine, other = ours[name], theirs.get(name)
        if isinstance(mine, dict) and isinstance(other, dict):
            out += _differences(mine, other, f"{prefix}{name}.")
        elif mine != other:
            out.append(f"{prefix}{name}={other!r} (now {mine!r})")
    return out


def load_weights(path: Path, config: TrainConfig) -> DiffLlamaForCausalLM:
    """The model stored in checkpoint directory ``path`` (as :func:`save_model` wrote it)."""
    if config.differential:
        return load_diffllama(path)
    model = DiffLlamaForCausalLM(config.model, differential=False)
    tied = config.model.tie_word_embeddings  # lm_head.weight is not stored then
    model.load_state_dict(load_file(Path(path) / "model.safetensors"), strict=not tied)
    return model


def save_model(model: DiffLlamaForCausalLM, config: DiffLlamaConfig, directory: Path,
               dtype: torch.dtype | None = None) -> Path:
    """``model`` (of architecture ``config``) in ``directory``: a DiffLlama checkpoint
    (:func:`save_diffllama`); a plain model as its own state dict (our fused names) with a
    ``config.json`` whose ``model_type`` is ``compiled_attn-plain-llama`` (no Hugging Face
    format)."""
    if model.differential:
        return save_diffllama(model, directory, dtype=dtype)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in model.state_dict().items()
             if not (config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    values = {**config_to_hf_dict(config, dtype or torch.float32),
              "model_type": "compiled_attn-plain-llama", "architectures": ["compiled_attn plain Llama"]}
    (directory / "config.json").write_text(json.dumps(values, indent=2) + "\n", encoding="utf-8")
    return directory


def write_checkpoint(config: TrainConfig, step: int, model: DiffLlamaForCausalLM, optimizer: torch.optim.Optimizer,
                     losses: list[float], val_history: list[tuple[int, float]]) -> Path:
    """Write ``config.out_dir/checkpoints/step_NNNNNN`` (float32 weights +
    ``trainer_state.pt``); a partly written one never has the final name."""
    final = config.out_dir / "checkpoints" / f"step_{step:06d}"
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    save_model(model, config.model, partial)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "settings": settings_of(config),
                "losses": losses, "val_history": [list(v) for v in val_history]},
               partial / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    return final
