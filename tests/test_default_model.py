"""The embedded default model of ``compiled-attn generate``: a byte-level DiffLlama trained on
the standard library's ``.py`` files (``compiled-attn train``), shipped in the package."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from compiled_attn.cli import main
from compiled_attn.data import IGNORE_INDEX, load_corpus, pack_rows
from compiled_attn.models import DEFAULT_MODEL_DIR, build_random_model, load_diffllama, random_model_config
from compiled_attn.train import shipped_config

MARGIN_BITS = 4.0
"""How many bits per byte the trained model must beat the random one by on held-out files
(measured 2026-11-30 on Python 3.11's validation files: 1.18 against 8.02)."""


def _bits_per_byte(model, batch) -> float:
    with torch.no_grad():
        logits = model(batch.metadata, None, all_logits=True)
    return F.cross_entropy(logits.float(), batch.targets, ignore_index=IGNORE_INDEX).item() / math.log(2)


def test_the_package_ships_the_trained_config_within_budget():
    weights = DEFAULT_MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= 16 * 10**6
    model = load_diffllama(DEFAULT_MODEL_DIR)
    assert sum(p.numel() for p in model.parameters()) <= 8 * 10**6
    assert dataclasses.asdict(model.config) == dataclasses.asdict(shipped_config())
    provenance = json.loads((DEFAULT_MODEL_DIR / "training.json").read_text(encoding="utf-8"))
    assert provenance["steps_done"] >= 1000 and provenance["device"] == "NVIDIA H200"


def test_default_model_predicts_held_out_stdlib_files_far_better_than_a_random_one():
    """Held-out: files of the validation split (the same rule by path as the training run's),
    here the standard library of the interpreter running the tests."""
    corpus = load_corpus(val_fraction=0.05)
    batch = pack_rows(corpus.val, range(0, 64, 8), 512)  # 8 rows of 512 bytes across the split
    trained = _bits_per_byte(load_diffllama(DEFAULT_MODEL_DIR), batch)
    random = _bits_per_byte(build_random_model(random_model_config(), seed=0), batch)
    assert trained < 2.0, f"the embedded model needs {trained:.3f} bits/byte on held-out files"
    assert trained < random - MARGIN_BITS, (trained, random)


@pytest.mark.parametrize("random_model", [False, True])
def test_generate_completes_python_in_printable_utf8(capsys, random_model):
    """The default's greedy completion of ``def fibonacci(n):`` is printable UTF-8 text with
    a line break (code goes on), which the random model's is not."""
    args = ["generate", "--no-compile", "--json", "--prompt", "def fibonacci(n):", "--max-new-tokens", "48"]
    assert main(args + ["--random-model"] * random_model) == 0
    completion = json.loads(capsys.readouterr().out)["completions"][0]
    raw = bytes(completion["generated_ids"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    python_like = text is not None and "\n" in text and all(c.isprintable() or c in "\n\t" for c in text)
    assert python_like != random_model, repr(raw)
