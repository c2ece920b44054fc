"""Load a Hugging Face DiffLlama directory (``config.json`` + safetensors).

Hugging Face's DiffLlama stores the two components of a head pair in *block halves*:
component 1 of pair ``j`` is query head ``j`` and component 2 is head ``j + H/2`` (KV
heads likewise with ``Hkv/2``); see ``DiffLlamaAttention.forward`` (``torch.chunk`` over
heads). Our layers and cache use *interleaved* pairs (heads ``2j``, ``2j + 1``), so the
rows of ``q_proj``, ``k_proj`` and ``v_proj`` are permuted once here, at load time. The
output of pair ``j`` stays at position ``j``, so ``o_proj`` is unchanged.

Our model also fuses projections that read the same input into one GEMM, as vLLM does
(``QKVParallelLinear``, ``MergedColumnParallelLinear`` and the ``stacked_params_mapping``
of its models' ``load_weights``): :data:`FUSED_PROJECTIONS` names them, and
:func:`fuse_state_dict` / :func:`unfuse_state_dict` convert between the two sets of names.
Loading checks names and shapes against the Hugging Face names, permutes heads, then fuses.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from einops import rearrange
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from ..distributed import TensorParallel
from .config import DiffLlamaConfig
from .diffllama import DiffLlamaForCausalLM
from .sharding import shard_model

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"
"""The embedded default model of ``compiled-attn generate`` (a Hugging Face DiffLlama
directory inside the package): a byte-level DiffLlama of about 6.95 M parameters
(:func:`compiled_attn.train.shipped_config`) trained by ``compiled-attn train`` on the
standard library's ``.py`` files; ``training.json`` beside the weights says how."""


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


FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
"""Fused module -> the Hugging Face modules whose output rows it stacks, in row order;
paths under ``model.layers.{i}``. A layer in ``config.kv_sharing`` projects only Q: it
keeps a plain ``self_attn.q_proj`` and has no ``qkv_proj``."""


def _fused_groups(config: DiffLlamaConfig):
    """``(fused, parts, rows)`` for each fused module of a model of ``config``: its path,
    the paths of the modules it stacks, and the output rows of each part."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    rows = {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [config.intermediate_size] * 2}
    for i in range(config.num_hidden_layers):
        for fused, parts in FUSED_PROJECTIONS.items():
            if fused == "self_attn.qkv_proj" and i in config.kv_sharing:
                continue
            prefix = f"model.layers.{i}."
            yield prefix + fused, [prefix + part for part in parts], rows[fused]


def fuse_state_dict(state: dict[str, torch.Tensor], config: DiffLlamaConfig) -> dict[str, torch.Tensor]:
    """Hugging Face projection tensors -> our fused ones: the row layouts of vLLM's
    ``QKVParallelLinear`` and ``MergedColumnParallelLinear`` (what its ``load_weights``
    builds with ``stacked_params_mapping``), for a whole state dict.

    In each layer, ``self_attn.q_proj`` ``[Hq * D, hidden]``, ``k_proj`` and ``v_proj``
    ``[Hkv * D, hidden]`` (biases ``[Hq * D]``, ``[Hkv * D]``) are concatenated along rows
    into ``self_attn.qkv_proj`` ``[(Hq + 2 * Hkv) * D, hidden]`` (bias ``[(Hq + 2 * Hkv) *
    D]``); ``mlp.gate_proj`` and ``up_proj`` ``[intermediate, hidden]`` into
    ``mlp.gate_up_proj`` ``[2 * intermediate, hidden]``. Layers in ``config.kv_sharing``
    keep their ``q_proj``. Other tensors pass through; dtypes are kept; head order is not
    changed (see :func:`halves_to_interleaved`).

    Returns:
        A new dict; ``state`` is left as it was.

    Raises:
        KeyError: some tensors of a group are present and others not (the key is the
            missing Hugging Face name).
    """
    fused_state = dict(state)
    for fused, parts, _ in _fused_groups(config):
        for suffix in (".weight", ".bias"):
            if any(part + suffix in state for part in parts):
                fused_state[fused + suffix] = torch.cat([fused_state.pop(part + suffix) for part in parts])
    return fused_state


def unfuse_state_dict(state: dict[str, torch.Tensor], config: DiffLlamaConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`fuse_state_dict`: our fused tensors split back along rows into the
    Hugging Face ones (views of the fused tensors), same shapes and dtypes as listed there.

    Returns:
        A new dict; ``state`` is left as it was.

    Raises:
        RuntimeError: a fused tensor's rows differ from the sizes ``config`` gives.
    """
    split_state = dict(state)
    for fused, parts, rows in _fused_groups(config):
        for suffix in (".weight", ".bias"):
            if fused + suffix in split_state:
                tensors = split_state.pop(fused + suffix).split(rows)
                split_state.update((part + suffix, tensor) for part, tensor in zip(parts, tensors))
    return split_state


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
    """Read ``model_dir/config.json`` (and ``eos_token_id`` from ``generation_config.json``,
    which transformers' ``generate`` prefers), every field checked before anything is built.

    Raises:
        FileNotFoundError: no directory or no ``config.json``.
        ValueError: unreadable JSON, not a DiffLlama config, an unsupported option or a
            field of the wrong type or range (see :meth:`DiffLlamaConfig.from_hf_dict`);
            the message starts with the file's path and names the field and the value.
    """
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist (or is not a directory)")
    if not path.is_file():
        raise FileNotFoundError(f"model directory {model_dir} has no config.json")
    values = _read_json(path)  # its errors name the file already
    try:
        config = DiffLlamaConfig.from_hf_dict(values)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    generation = Path(model_dir) / "generation_config.json"  # transformers' generate reads EOS here
    if generation.is_file() and "eos_token_id" in (values := _read_json(generation)):
        try:
            config = dataclasses.replace(config, eos_token_id=values["eos_token_id"])  # re-checked
        except ValueError as err:
            raise ValueError(f"{generation}: {err}") from None
    return config


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(value).__name__}")
    return value


def load_diffllama(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu", tp: TensorParallel | None = None) -> DiffLlamaForCausalLM:
    """Build a :class:`DiffLlamaForCausalLM` from a Hugging Face DiffLlama directory.

    Args:
        model_dir: directory with ``config.json`` and ``model.safetensors`` (or a sharded
            index).
        dtype: parameter dtype (float32, float16, bfloat16).
        device: where the model goes.
        tp: load only rank ``tp.rank``'s shard (see :func:`_load_shard`): the result equals
            ``shard_model(load_diffllama(model_dir, dtype, device), tp)``, but the rank reads
            only its slices of the sharded tensors. ``None`` or a world of one: the whole model.

    Returns:
        The model (or its shard) in eval mode with gradients off.

    Raises:
        FileNotFoundError: no ``model_dir``, no ``config.json``, no ``model.safetensors``
            (nor index), or shards listed in the index that are absent.
        ValueError: every other problem, so the CLI exits 2 with the message:

            * ``config.json`` (or ``generation_config.json``) is not valid JSON or not an
              object;
            * not a DiffLlama (``model_type``), or an option this implementation lacks:
              RoPE scaling (``rope_scaling`` / ``rope_parameters`` of a type other than
              ``'default'``), ``hidden_act`` other than SiLU, ``attention_dropout`` > 0;
            * a config field of the wrong type or range, checked before any tensor is
              read or allocated (sizes ints > 0, ``rms_norm_eps`` / ``rope_theta``
              finite > 0, booleans bools, token ids ints, ...; see
              :func:`compiled_attn.models.config._validate_fields`), head counts or a head
              size the differential layers cannot use, or a bad ``kv_sharing`` map; the
              message names the field, the value given and what is allowed;
            * a weight file that is not readable safetensors (truncated, oversized or
              corrupt header);
            * a tensor holding NaN or infinity (named as in the checkpoint, with its file);
            * tensors missing, unexpected or of the wrong shape for the config (named as in
              the checkpoint: ``q_proj``, not ``qkv_proj``), found before the model is
              allocated.
    """
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    if tp is not None and tp.world_size > 1:
        return _load_shard(model_dir, config, tp).to(device=device, dtype=dtype)
    state = {}
    for path in _weight_files(model_dir):
        try:
            tensors = load_file(path)
        except SafetensorError as err:
            raise ValueError(f"{path} is not a readable safetensors file: {err}") from None
        for name, tensor in tensors.items():
            _check_finite(name, tensor, path)
        state.update(tensors)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    _check_names_and_shapes(model_dir, config, {k: tuple(v.shape) for k, v in state.items()})
    for key in list(state):
        heads = projection_heads(key, config)
        if heads is not None:
            state[key] = halves_to_interleaved(state[key], heads)
    model = DiffLlamaForCausalLM(config)
    model.load_state_dict(fuse_state_dict(state, config), strict=False)  # lm_head is absent when tied
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _check_finite(name: str, tensor: torch.Tensor, path: Path) -> None:
    """Raise ValueError when floating-point ``tensor`` holds NaN or infinity."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        nan = int(torch.isnan(tensor).sum())
        inf = int(torch.isinf(tensor).sum())
        raise ValueError(
            f"tensor {name} in {path} holds non-finite values ({nan} NaN, {inf} inf of "
            f"{tensor.numel()}); every weight must be a finite number"
        )


def _first(items: list[str], n: int = 5) -> str:
    return f"{items[:n]}{'...' if len(items) > n else ''}"


def _check_names_and_shapes(model_dir: Path, config: DiffLlamaConfig, shapes: dict[str, tuple]) -> None:
    """Raise ValueError unless ``shapes`` (Hugging Face name -> shape, without ``lm_head``
    when tied) are exactly the tensors of a DiffLlama of ``config``."""
    with torch.device("meta"):  # names and shapes only: nothing is allocated
        skeleton = DiffLlamaForCausalLM(config)
    expected = unfuse_state_dict(skeleton.state_dict(), config)  # Hugging Face names and shapes
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    missing, unexpected = sorted(expected.keys() - shapes.keys()), sorted(shapes.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"weights in {model_dir} do not match a DiffLlama of this config: "
            f"missing {_first(missing)}, unexpected {_first(unexpected)}"
        )
    wrong = [f"{k} {list(shapes[k])} (expected {list(v.shape)})"
             for k, v in expected.items() if tuple(shapes[k]) != tuple(v.shape)]
    if wrong:
        raise ValueError(f"weights in {model_dir} do not fit the config: {_first(wrong)}")


class _SliceReader:
    """Reads slices of named tensors from open safetensors files (``safe_open`` handles)."""

    def __init__(self, handles: dict[str, tuple[object, Path]]) -> None:
        self.handles = handles  # Hugging Face name -> (handle, path)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[name][0].get_slice(name).get_shape())

    def __call__(self, name: str, rows: tuple[int, int] | None = None,
                 cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows ``[a, b)`` or columns ``[a, b)`` (or all) of tensor ``name``, checked finite."""
        handle, path = self.handles[name]
        piece = handle.get_slice(name)
        tensor = piece[rows[0]:rows[1]] if rows else piece[:, cols[0]:cols[1]] if cols else piece[:]
        _check_finite(name, tensor, path)
        return tensor


def _pair_rows(read: _SliceReader, name: str, heads: int, head_dim: int, tp: TensorParallel) -> torch.Tensor:
    """Rank ``tp.rank``'s pairs of a block-halves Q/K/V tensor, interleaved: in Hugging Face
    rows ``(two, pair, d)`` the rank's pairs are one contiguous run in each half."""
    pairs = heads // 2 // tp.world_size
    halves = [read(name, rows=((two * heads // 2 + tp.rank * pairs) * head_dim,
                               (two * heads // 2 + (tp.rank + 1) * pairs) * head_dim)) for two in (0, 1)]
    return halves_to_interleaved(torch.cat(halves), 2 * pairs)


def _read_shard_tensor(name: str, config: DiffLlamaConfig, tp: TensorParallel, read: _SliceReader) -> torch.Tensor:
    """Rank ``tp.rank``'s value of our parameter ``name``, as :func:`shard_model` slices it,
    read from the Hugging Face tensors (only the needed rows or columns)."""
    r, w = tp.rank, tp.world_size
    module_path, _, leaf = name.rpartition(".")
    base, _, module = module_path.rpartition(".")

    def chunk(n: int) -> tuple[int, int]:
        return r * n // w, (r + 1) * n // w

    if module in ("qkv_proj", "q_proj") and base.endswith("self_attn"):
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads,
                 "v_proj": config.num_key_value_heads}
        parts = ("q_proj", "k_proj", "v_proj") if module == "qkv_proj" else ("q_proj",)
        return torch.cat([_pair_rows(read, f"{base}.{p}.{leaf}", heads[p], config.head_dim, tp) for p in parts])
    if module == "gate_up_proj":
        return torch.cat([read(f"{base}.{p}.{leaf}", rows=chunk(config.intermediate_size))
                          for p in ("gate_proj", "up_proj")])
    if module in ("o_proj", "down_proj"):
        if leaf == "bias":  # added once, by rank 0
            return read(name) if r == 0 else torch.zeros(read.shape(name))
        return read(name, cols=chunk(read.shape(name)[1]))
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return read(name, rows=chunk(config.vocab_size))
    return read(name)  # norms, lambdas, subln: replicated


def _load_shard(model_dir: Path, config: DiffLlamaConfig, tp: TensorParallel) -> DiffLlamaForCausalLM:
    """Rank ``tp.rank``'s shard, read with ``safe_open(...).get_slice``: the sharded
    skeleton (:func:`shard_model` on the meta device) gives the names, and each parameter is
    read as the rows or columns of the Hugging Face tensors that permutation, fusion and
    sharding would keep. Non-persistent buffers (RoPE frequencies, ALiBi slopes) come from a
    shard of a tiny model of the same heads and layers. Only the read slices are checked
    finite; names and shapes are all checked, from the file headers, before any read."""
    try:
        handles = [(safe_open(path, framework="pt"), path) for path in _weight_files(model_dir)]
    except SafetensorError as err:
        raise ValueError(f"{model_dir} has a weight file that is not readable safetensors: {err}") from None
    read = _SliceReader({name: (h, path) for h, path in handles for name in h.keys()})
    shapes = {name: read.shape(name) for name in read.handles
              if not (config.tie_word_embeddings and name == "lm_head.weight")}
    _check_names_and_shapes(model_dir, config, shapes)
    with torch.device("meta"):
        model = shard_model(DiffLlamaForCausalLM(config), tp)
    tiny = dataclasses.replace(config, hidden_size=2, intermediate_size=tp.world_size, vocab_size=tp.world_size)
    buffers = dict(shard_model(DiffLlamaForCausalLM(tiny), tp).named_buffers())
    names = {id(p): n for n, p in model.named_parameters()}  # tied weights: the first name
    loaded: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules():
        for key, param in module._parameters.items():
            if param is not None and id(param) not in loaded:
                value = _read_shard_tensor(names[id(param)], config, tp, read)
                assert value.shape == param.shape, (names[id(param)], value.shape, param.shape)
                loaded[id(param)] = nn.Parameter(value, requires_grad=False)
            if param is not None:
                module._parameters[key] = loaded[id(param)]
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = buffers[f"{prefix}.{key}" if prefix else key]
    return model.eval().requires_grad_(False)
