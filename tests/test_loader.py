"""Checkpoint loading: the head permutation, the projection fusion and every error of
load_diffllama."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from compiled_attn.metadata import SequenceChunk, build_metadata
from compiled_attn.models import (
    DiffLlamaConfig, DiffLlamaForCausalLM, build_random_model, load_diffllama, save_diffllama,
)
from compiled_attn.models.loader import (
    fuse_state_dict, halves_to_interleaved, interleaved_to_halves, load_config, unfuse_state_dict,
)

transformers = pytest.importorskip("transformers")

NUM_HEADS, NUM_KV_HEADS = 8, 4


def test_halves_to_interleaved_labelled_rows():
    # 4 heads of head_dim 2; row value = 10 * head + dim. Halves: pair j = heads (j, j + 2).
    rows = torch.tensor([10 * h + d for h in range(4) for d in range(2)])
    out = halves_to_interleaved(rows, 4)
    assert out.tolist() == [0, 1, 20, 21, 10, 11, 30, 31]
    # 6 heads of dim 1: pairs (0, 3), (1, 4), (2, 5).
    assert halves_to_interleaved(torch.arange(6), 6).tolist() == [0, 3, 1, 4, 2, 5]
    # 2 heads: already a single pair, unchanged.
    assert halves_to_interleaved(torch.arange(6), 2).tolist() == list(range(6))


def test_interleaved_to_halves_inverts_the_load_permutation():
    weight = torch.randn(12 * 4, 5)  # 12 heads of 4
    assert torch.equal(interleaved_to_halves(halves_to_interleaved(weight, 12), 12), weight)
    assert interleaved_to_halves(torch.arange(6), 6).tolist() == [0, 2, 4, 1, 3, 5]


def test_halves_to_interleaved_weight_matrix_keeps_columns():
    weight = torch.arange(8 * 3).reshape(8, 3)  # 4 heads x dim 2 rows, 3 input features
    out = halves_to_interleaved(weight, 4)
    assert out.shape == (8, 3)
    order = [0, 1, 4, 5, 2, 3, 6, 7]
    assert torch.equal(out, weight[order])


def hf_config(**overrides):
    values = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
                  max_position_embeddings=32, lambda_std_dev=0.3)
    values.update(overrides)
    return transformers.DiffLlamaConfig(**values)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = transformers.DiffLlamaForCausalLM(hf_config()).eval()
    path = tmp_path_factory.mktemp("diffllama")
    model.save_pretrained(path)
    return path


@pytest.fixture
def ckpt_copy(checkpoint, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path: Path, edit) -> None:
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def test_load_permutes_qkv_and_keeps_the_rest(checkpoint):
    hf_state = load_file(checkpoint / "model.safetensors")
    model = load_diffllama(checkpoint)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert "model.layers.0.self_attn.qkv_proj.weight" in model.state_dict()
    ours = unfuse_state_dict(model.state_dict(), model.config)
    assert ours.keys() == hf_state.keys()
    assert model.config.num_attention_heads == NUM_HEADS and model.config.head_dim == 8
    assert model.config.eos_token_ids == frozenset({2})
    for key, value in hf_state.items():
        if key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            heads = NUM_HEADS if "q_proj" in key else NUM_KV_HEADS
            expected = halves_to_interleaved(value, heads)
            if heads > 2:  # with 2 heads (one pair) the two layouts coincide
                assert not torch.equal(expected, value)
        else:
            expected = value
        assert torch.equal(ours[key], expected), key


@pytest.mark.parametrize("bias", [False, True])
def test_loaded_model_matches_transformers_logits(checkpoint, tmp_path, bias):
    """The permutation is the right one: same logits as transformers' DiffLlama."""
    if bias:  # q/k/v biases are permuted too
        torch.manual_seed(2)
        biased = transformers.DiffLlamaForCausalLM(hf_config(attention_bias=True)).eval()
        with torch.no_grad():
            for name, param in biased.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.5)
        biased.save_pretrained(tmp_path)
        checkpoint = tmp_path
    assert_matches_transformers(load_diffllama(checkpoint), checkpoint)


def assert_matches_transformers(model, checkpoint: Path) -> None:
    """Our model's logits equal those of transformers' DiffLlama loaded from ``checkpoint``."""
    hf = transformers.DiffLlamaForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    ids = [3, 17, 9, 40, 5, 22]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    md = build_metadata([SequenceChunk(ids, 0, [0, 1])], 4, 2)
    with torch.inference_mode():
        got = model(md, None, all_logits=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _hf_state(bias: bool, kv_heads: int, kv_sharing: dict[int, int]):
    """A transformers DiffLlama's state dict (Hugging Face names) and our config of it; the
    K/V projections of ``kv_sharing`` layers are dropped, as such a layer has none."""
    torch.manual_seed(3)
    hf = transformers.DiffLlamaForCausalLM(hf_config(attention_bias=bias, num_key_value_heads=kv_heads,
                                                     num_hidden_layers=3))
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    if bias:
        state.update({k: torch.randn_like(v) for k, v in state.items() if k.endswith("bias")})
    for layer in kv_sharing:
        for name in ("k_proj", "v_proj"):
            for suffix in ("weight", "bias"):
                state.pop(f"model.layers.{layer}.self_attn.{name}.{suffix}", None)
    config = DiffLlamaConfig.from_hf_dict(hf.config.to_dict())
    return state, dataclasses.replace(config, kv_sharing=kv_sharing)


@pytest.mark.parametrize("bias, kv_heads, kv_sharing", [(False, NUM_KV_HEADS, {}), (True, NUM_KV_HEADS, {}),
                                                        (True, 2, {2: 0}), (False, NUM_HEADS, {1: 0, 2: 0})])
def test_fuse_unfuse_round_trip(bias, kv_heads, kv_sharing):
    hf_state, config = _hf_state(bias, kv_heads, kv_sharing)
    before = {k: v.clone() for k, v in hf_state.items()}
    fused = fuse_state_dict(hf_state, config)
    assert hf_state.keys() == before.keys() and all(torch.equal(hf_state[k], before[k]) for k in before)
    model_state = DiffLlamaForCausalLM(config).state_dict()
    assert fused.keys() == model_state.keys()
    assert all(fused[k].shape == v.shape for k, v in model_state.items())
    layer = "model.layers.0."  # never a sharing layer: rows stacked in Q, K, V / gate, up order
    for suffix in ("weight", "bias") if bias else ("weight",):
        parts = [hf_state[f"{layer}self_attn.{p}.{suffix}"] for p in ("q_proj", "k_proj", "v_proj")]
        assert torch.equal(fused[f"{layer}self_attn.qkv_proj.{suffix}"], torch.cat(parts))
    parts = [hf_state[f"{layer}mlp.{p}.weight"] for p in ("gate_proj", "up_proj")]
    assert torch.equal(fused[f"{layer}mlp.gate_up_proj.weight"], torch.cat(parts))
    back = unfuse_state_dict(fused, config)
    assert back.keys() == before.keys()
    assert all(torch.equal(back[k], before[k]) and back[k].dtype == before[k].dtype for k in before)
    ours = build_random_model(config, seed=1).state_dict()
    refused = fuse_state_dict(unfuse_state_dict(ours, config), config)
    assert refused.keys() == ours.keys() and all(torch.equal(refused[k], ours[k]) for k in ours)


@pytest.mark.parametrize("bias", [False, True])
def test_saved_hf_checkpoint_round_trips_and_matches_transformers(tmp_path, bias):
    """Our model written by save_diffllama (unfuse + halves) loads back exactly
    and gives transformers' logits."""
    config = DiffLlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
                             attention_bias=bias, bos_token_id=None, eos_token_id=None)
    model = build_random_model(config, seed=2)
    with torch.no_grad():  # build_random_model zeroes biases
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    save_diffllama(model, tmp_path)
    loaded = load_diffllama(tmp_path).state_dict()
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert_matches_transformers(model, tmp_path)


def test_load_bfloat16(checkpoint):
    model = load_diffllama(checkpoint, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_tied_embeddings(tmp_path):
    torch.manual_seed(1)
    transformers.DiffLlamaForCausalLM(hf_config(tie_word_embeddings=True)).save_pretrained(tmp_path)
    model = load_diffllama(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_directory(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model does not exist"):
        load_diffllama(missing)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        load_diffllama(tmp_path)


def test_config_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json must hold a JSON object, got a list"):
        load_diffllama(tmp_path)


def test_llama_config_is_rejected(ckpt_copy):
    edit_config(ckpt_copy, model_type="llama")
    with pytest.raises(ValueError, match=r"model_type='llama'.*diffllama"):
        load_diffllama(ckpt_copy)
    with pytest.raises(ValueError, match="llama"):
        load_config(ckpt_copy)


def test_config_without_model_type_is_rejected(ckpt_copy):
    edit_config(ckpt_copy, model_type=None)
    with pytest.raises(ValueError, match="model_type=None"):
        load_diffllama(ckpt_copy)


def test_missing_safetensors(ckpt_copy):
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_diffllama(ckpt_copy)


def test_sharded_index_with_missing_shard(ckpt_copy):
    (ckpt_copy / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (ckpt_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_diffllama(ckpt_copy)


def test_sharded_checkpoint_loads(checkpoint, ckpt_copy):
    state = load_file(ckpt_copy / "model.safetensors")
    (ckpt_copy / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for name, shard_keys in shards.items():
        save_file({k: state[k] for k in shard_keys}, ckpt_copy / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard_keys})
    (ckpt_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_diffllama(ckpt_copy).state_dict()
    whole = load_diffllama(checkpoint).state_dict()
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)


def test_missing_tensor_is_listed(ckpt_copy):
    edit_weights(ckpt_copy, lambda s: s.pop("model.layers.1.self_attn.lambda_k2"))
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.1\.self_attn\.lambda_k2'\]"):
        load_diffllama(ckpt_copy)


@pytest.mark.parametrize("key", ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.weight",
                                 "model.layers.1.mlp.up_proj.weight"])
def test_missing_fused_part_is_named_as_in_the_checkpoint(ckpt_copy, key):
    edit_weights(ckpt_copy, lambda s: s.pop(key))
    with pytest.raises(ValueError, match=rf"missing \[{re.escape(repr(key))}\]") as err:
        load_diffllama(ckpt_copy)
    assert "qkv_proj" not in str(err.value) and "gate_up_proj" not in str(err.value)


def test_wrong_shape_of_a_fused_part_is_named_as_in_the_checkpoint(ckpt_copy):
    edit_weights(ckpt_copy, lambda s: s.__setitem__("model.layers.0.self_attn.v_proj.weight", torch.ones(8, 64)))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.v_proj\.weight \[8, 64\] \(expected \[32, 64\]\)"):
        load_diffllama(ckpt_copy)


def test_extra_tensor_is_listed(ckpt_copy):
    edit_weights(ckpt_copy, lambda s: s.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8)))
    with pytest.raises(ValueError, match=r"unexpected \['model\.layers\.0\.self_attn\.rotary_emb\.inv_freq'\]"):
        load_diffllama(ckpt_copy)


def test_missing_lm_head_of_untied_model_is_listed(ckpt_copy):
    edit_weights(ckpt_copy, lambda s: s.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing \['lm_head\.weight'\]"):
        load_diffllama(ckpt_copy)


def test_wrong_shape_is_a_value_error(ckpt_copy):
    edit_weights(ckpt_copy, lambda s: s.__setitem__("model.norm.weight", torch.ones(32)))
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_diffllama(ckpt_copy)


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
        {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 5e5},
    ],
)
def test_unsupported_rope_type(ckpt_copy, changes):
    edit_config(ckpt_copy, **changes)
    with pytest.raises(ValueError, match=r"rope_type '(linear|yarn|dynamic)' is not supported"):
        load_diffllama(ckpt_copy)


def test_legacy_rope_fields(ckpt_copy):
    edit_config(ckpt_copy, rope_parameters=None, rope_scaling=None, rope_theta=500000.0)
    assert load_config(ckpt_copy).rope_theta == 500000.0
    edit_config(ckpt_copy, rope_parameters={"rope_type": "default", "rope_theta": 1234.0})
    assert load_config(ckpt_copy).rope_theta == 1234.0


@pytest.mark.parametrize("changes, match", [({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                                            ({"attention_dropout": 0.1}, "attention_dropout")])
def test_other_unsupported_options(ckpt_copy, changes, match):
    edit_config(ckpt_copy, **changes)
    with pytest.raises(ValueError, match=match):
        load_diffllama(ckpt_copy)


def test_unreadable_files_and_odd_heads_are_value_errors(ckpt_copy):
    (ckpt_copy / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        load_diffllama(ckpt_copy)
    edit_config(ckpt_copy, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="even number of query and KV heads"):
        load_config(ckpt_copy)


def test_generation_config_eos_wins(ckpt_copy):
    (ckpt_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert load_config(ckpt_copy).eos_token_ids == frozenset({5, 7})
