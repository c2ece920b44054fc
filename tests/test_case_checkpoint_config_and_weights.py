"""Case ``checkpoint-config-and-weights``: a Hugging Face DiffLlama directory whose
``config.json`` holds fields of the wrong type or range, or whose weights hold NaN / inf,
is refused at load with a clear ValueError (CLI exit 2) naming the field and the value, or
the tensor; never a raw traceback, never a model that loads and generates garbage."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch

import compiled_attn.models.loader as loader_module
from compiled_attn.cli import main
from compiled_attn.models import DiffLlamaConfig, load_diffllama

# The transformers-saved checkpoint (8 heads, 4 KV heads, head_dim 8, vocab 64) and its
# editors live with the loader's own tests; the fixtures are used by name.
from test_loader import checkpoint, ckpt_copy, edit_config, edit_weights  # noqa: F401

pytest.importorskip("transformers")

GENERATE = ["generate", "--no-compile", "--json", "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]


def run_cli(capsys, model_dir: Path) -> tuple[int, str, str]:
    code = main([*GENERATE, "--model", str(model_dir)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_clean_error(capsys, model_dir: Path, message: str) -> str:
    """The CLI exits 2 with exactly ``compiled-attn: error: <message>`` and no traceback."""
    code, out, err = run_cli(capsys, model_dir)
    assert code == 2, err
    assert out == ""
    assert err == f"compiled-attn: error: {message}\n"
    assert "Traceback" not in err
    return err


def set_config(path: Path, **changes) -> None:
    """Like ``edit_config`` but a ``None`` is written as JSON null (not removed)."""
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


# -- the two reported edits -------------------------------------------------------------


def test_string_num_attention_heads_exits_2_naming_field_and_value(capsys, ckpt_copy):
    edit_config(ckpt_copy, num_attention_heads="4")
    err = assert_clean_error(
        capsys, ckpt_copy,
        f"{ckpt_copy / 'config.json'}: num_attention_heads must be an int > 0, got '4' (str)")
    assert "not supported between instances" not in err


def test_nan_embedding_exits_2_naming_the_tensor(capsys, ckpt_copy):
    def poison(state):
        state["model.embed_tokens.weight"][3, 5] = float("nan")
    edit_weights(ckpt_copy, poison)
    assert_clean_error(
        capsys, ckpt_copy,
        f"tensor model.embed_tokens.weight in {ckpt_copy / 'model.safetensors'} holds non-finite "
        f"values (1 NaN, 0 inf of {64 * 64}); every weight must be a finite number")


# -- the whole kind: config fields ---------------------------------------------------------

SIZE = "an int > 0"
NUMBER_POS = "a finite number > 0"
BOOL = "a bool (true or false)"
IDS = "a token id (an int >= 0), a list of them, or null"

CONFIG_CASES = [
    # ints given as bool, float, str; sizes <= 0
    ({"num_hidden_layers": True}, "num_hidden_layers", SIZE, "True (bool)"),
    ({"hidden_size": 64.0}, "hidden_size", SIZE, "64.0 (float)"),
    ({"intermediate_size": "96"}, "intermediate_size", SIZE, "'96' (str)"),
    ({"vocab_size": -64}, "vocab_size", SIZE, "-64 (int)"),
    ({"max_position_embeddings": 0}, "max_position_embeddings", SIZE, "0 (int)"),
    ({"max_position_embeddings": None}, "max_position_embeddings", SIZE, "None (NoneType)"),
    ({"num_key_value_heads": 4.5}, "num_key_value_heads", SIZE + " or null", "4.5 (float)"),
    ({"head_dim": False}, "head_dim", SIZE + " or null", "False (bool)"),
    # floats: finite, in range
    ({"rms_norm_eps": math.inf}, "rms_norm_eps", NUMBER_POS, "inf (float)"),
    ({"rms_norm_eps": 0}, "rms_norm_eps", NUMBER_POS, "0 (int)"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps", NUMBER_POS, "'1e-5' (str)"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta", NUMBER_POS, "-1.0 (float)"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": math.nan}}, "rope_theta", NUMBER_POS,
     "nan (float)"),
    ({"lambda_std_dev": -0.1}, "lambda_std_dev", "a finite number >= 0", "-0.1 (float)"),
    ({"lambda_init": "0.8"}, "lambda_init", "a finite number", "'0.8' (str)"),
    ({"lambda_init": -math.inf}, "lambda_init", "a finite number", "-inf (float)"),
    # booleans
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings", BOOL, "'false' (str)"),
    ({"attention_bias": 0}, "attention_bias", BOOL, "0 (int)"),
    ({"subln_affine": 1}, "subln_affine", BOOL, "1 (int)"),
    # optional ids, window, kv_sharing
    ({"eos_token_id": "2"}, "eos_token_id", IDS, "'2' (str)"),
    ({"eos_token_id": [2, 3.0]}, "eos_token_id", IDS, "[2, 3.0] (list)"),
    ({"bos_token_id": -1}, "bos_token_id", IDS, "-1 (int)"),
    ({"bos_token_id": True}, "bos_token_id", IDS, "True (bool)"),
    ({"sliding_window": 0}, "sliding_window", "an int >= 1 or null", "0 (int)"),
    ({"sliding_window": 4.0}, "sliding_window", "an int >= 1 or null", "4.0 (float)"),
    ({"kv_sharing": {"one": 0}}, "kv_sharing", "a map from layer index to an earlier layer index (ints)",
     "{'one': 0} (dict)"),
]


@pytest.mark.parametrize("changes, field, allowed, given", CONFIG_CASES,
                         ids=[f"{c[1]}={c[3].split(' (')[0]}" for c in CONFIG_CASES])
def test_config_field_of_wrong_type_or_range_exits_2(capsys, ckpt_copy, changes, field, allowed, given):
    set_config(ckpt_copy, **changes)
    message = f"{ckpt_copy / 'config.json'}: {field} must be {allowed}, got {given}"
    assert_clean_error(capsys, ckpt_copy, message)
    with pytest.raises(ValueError) as err:
        load_diffllama(ckpt_copy)
    assert str(err.value) == message


ROPE_ONLY_DEFAULT = "(only 'default'; RoPE scaling is not implemented)"

OPTION_CASES = [
    # a legacy rope_scaling next to transformers 5's default rope_parameters was ignored before
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope_scaling: rope_type 'linear' is not supported " + ROPE_ONLY_DEFAULT
     + ", got rope_scaling={'rope_type': 'linear', 'factor': 2.0}"),
    ({"rope_parameters": None, "rope_scaling": {"type": "su", "factor": 4.0}},
     "rope_scaling: rope_type 'su' is not supported " + ROPE_ONLY_DEFAULT
     + ", got rope_scaling={'type': 'su', 'factor': 4.0}"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}},
     "rope_parameters: rope_type 'longrope' is not supported " + ROPE_ONLY_DEFAULT
     + ", got rope_parameters={'rope_type': 'longrope', 'rope_theta': 10000.0}"),
    ({"rope_scaling": {"factor": 2.0}},  # no type named: refused, not read as 'default'
     "rope_scaling: rope_type None is not supported " + ROPE_ONLY_DEFAULT
     + ", got rope_scaling={'factor': 2.0}"),
    ({"rope_scaling": "linear"},
     "rope_scaling must be an object with a 'rope_type', or null, got 'linear' (str)"),
    ({"attention_dropout": "0"},
     "attention_dropout must be 0 (dropout > 0 is not supported for inference), got '0' (str)"),
    ({"head_dim": 257},
     "head_dim: head size 257 is not supported; allowed: any int from 1 to 256 (as flash-attn)"),
]


@pytest.mark.parametrize("changes, message", OPTION_CASES,
                         ids=["rope_scaling-linear", "legacy-su", "longrope", "no-type", "not-object",
                              "dropout-str", "head_dim-257"])
def test_unsupported_or_malformed_options_exit_2(capsys, ckpt_copy, changes, message):
    set_config(ckpt_copy, **changes)
    assert_clean_error(capsys, ckpt_copy, f"{ckpt_copy / 'config.json'}: {message}")


def test_default_rope_scaling_is_accepted(ckpt_copy):
    set_config(ckpt_copy, rope_scaling={"rope_type": "default"}, sliding_window=None, lambda_init=None)
    assert load_diffllama(ckpt_copy).config.rope_theta == 10000.0
    set_config(ckpt_copy, rope_scaling=None, rope_parameters={"rope_theta": 5e5})  # no type, no scaling
    assert load_diffllama(ckpt_copy).config.rope_theta == 5e5


def test_bad_eos_in_generation_config_names_that_file(capsys, ckpt_copy):
    generation = ckpt_copy / "generation_config.json"
    generation.write_text(json.dumps({"eos_token_id": ["2"]}))
    assert_clean_error(capsys, ckpt_copy, f"{generation}: eos_token_id must be {IDS}, got ['2'] (list)")


def test_config_is_checked_before_any_tensor_is_read(ckpt_copy, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("weights were read before the config was checked")
    monkeypatch.setattr(loader_module, "load_file", no_load)
    edit_config(ckpt_copy, hidden_size="64")
    with pytest.raises(ValueError, match=r"hidden_size must be an int > 0, got '64' \(str\)"):
        load_diffllama(ckpt_copy)


def test_python_config_is_checked_too():
    with pytest.raises(ValueError, match=r"^num_hidden_layers must be an int > 0, got 2\.0 \(float\)$"):
        DiffLlamaConfig(num_hidden_layers=2.0)
    with pytest.raises(ValueError, match=r"^attention_bias must be a bool \(true or false\), got 'no' \(str\)$"):
        DiffLlamaConfig(attention_bias="no")


def test_config_that_does_not_fit_the_weights_is_refused_before_allocating(ckpt_copy):
    # A vocabulary of 2**40 rows would need 2**40 * 64 * 4 bytes; the shapes are compared first.
    edit_config(ckpt_copy, vocab_size=2**40)
    with pytest.raises(ValueError, match=rf"model\.embed_tokens\.weight \[64, 64\] \(expected \[{2**40}, 64\]\)"):
        load_diffllama(ckpt_copy)


# -- the whole kind: weights -----------------------------------------------------------------


@pytest.mark.parametrize("name, index, value, counts", [
    ("model.embed_tokens.weight", (0, 0), float("inf"), "0 NaN, 1 inf of 4096"),
    ("model.layers.1.self_attn.q_proj.weight", (7, 2), float("-inf"), "0 NaN, 1 inf of 4096"),
    ("model.layers.0.self_attn.lambda_k2", (3,), float("nan"), "1 NaN, 0 inf of 8"),
    ("model.norm.weight", (0,), float("nan"), "1 NaN, 0 inf of 64"),
    ("lm_head.weight", (63, 63), float("inf"), "0 NaN, 1 inf of 4096"),
])
def test_non_finite_tensor_exits_2_naming_it(capsys, ckpt_copy, name, index, value, counts):
    def poison(state):
        state[name][index] = value
    edit_weights(ckpt_copy, poison)
    message = (f"tensor {name} in {ckpt_copy / 'model.safetensors'} holds non-finite values ({counts}); "
               "every weight must be a finite number")
    assert_clean_error(capsys, ckpt_copy, message)


def test_non_finite_bfloat16_tensor_is_refused(ckpt_copy):
    def to_bf16(state):
        for key in state:
            state[key] = state[key].to(torch.bfloat16)
        state["model.layers.0.mlp.down_proj.weight"][1, 1] = float("nan")
    edit_weights(ckpt_copy, to_bf16)
    with pytest.raises(ValueError, match=r"^tensor model\.layers\.0\.mlp\.down_proj\.weight in .* \(1 NaN, 0 inf"):
        load_diffllama(ckpt_copy)


# -- existing clear errors are kept; a valid checkpoint still loads -----------------------------


def test_truncated_safetensors_exits_2(capsys, ckpt_copy):
    path = ckpt_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    code, out, err = run_cli(capsys, ckpt_copy)
    assert code == 2 and out == ""
    assert err.startswith(f"compiled-attn: error: {path} is not a readable safetensors file: ")


def test_oversized_header_safetensors_exits_2(capsys, ckpt_copy):
    path = ckpt_copy / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    code, out, err = run_cli(capsys, ckpt_copy)
    assert code == 2 and out == ""
    assert err.startswith(f"compiled-attn: error: {path} is not a readable safetensors file: ")


def test_valid_checkpoint_still_loads_and_generates(capsys, checkpoint):
    model = load_diffllama(checkpoint)
    assert model.config.num_attention_heads == 8 and model.config.rms_norm_eps == 1e-5
    assert all(torch.isfinite(p).all() for p in model.parameters())
    code, out, err = run_cli(capsys, checkpoint)
    assert code == 0, err
    (completion,) = json.loads(out)["completions"]
    assert completion["prompt_ids"] == [1, 2, 3] and len(completion["generated_ids"]) == 2
