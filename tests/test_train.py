"""Training (compiled_attn.train), its data (compiled_attn.data) and the checkpoint writer
(save_diffllama): tiny CPU runs, resume, round trips through our loader and transformers."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from compiled_attn.cli import main
from compiled_attn.data import (
    IGNORE_INDEX, corpus_files, is_validation_file, load_corpus, pack_rows, stdlib_root, train_rows,
)
from compiled_attn.metadata import SequenceChunk, build_metadata
from compiled_attn.models import DiffLlamaConfig, build_random_model, load_diffllama, save_diffllama
from compiled_attn.train import (
    TrainConfig, Trainer, flops_per_token, learning_rate, parameter_counts, tiny_config, train,
)

VAL_FRACTION = 0.2
PACKAGES = ("json", "email", "tomllib", "zoneinfo")  # small stdlib packages: many document boundaries


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory) -> Path:
    """Copies of a few stdlib packages, plus an empty file and a Latin-1 one (both skipped)."""
    root = tmp_path_factory.mktemp("corpus")
    for package in PACKAGES:
        shutil.copytree(stdlib_root() / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "empty.py").write_bytes(b"")
    (root / "latin1.py").write_bytes("# caf\u00e9\n".encode("latin-1") * 20)
    return root


@pytest.fixture(scope="module")
def corpus(corpus_root):
    return load_corpus(corpus_root, VAL_FRACTION)


def tiny_run(out_dir: Path, corpus_root: Path, **overrides) -> TrainConfig:
    values = dict(out_dir=out_dir, model=tiny_config(), steps=8, batch_rows=4, seq_len=64, lr=3e-3,
                  warmup_steps=2, eval_every=0, val_tokens=1024, checkpoint_every=0, log_every=2, compile=False,
                  progress=False, data_root=corpus_root, val_fraction=VAL_FRACTION)
    values.update(overrides)
    return TrainConfig(**values)


# --- data -----------------------------------------------------------------------------------

def test_split_is_deterministic_disjoint_and_by_relative_path(corpus_root, corpus, tmp_path):
    files = corpus_files()  # the whole standard library
    split = [is_validation_file(f, 0.05) for f in files]
    assert split == [is_validation_file(f, 0.05) for f in files]
    assert 0.02 < sum(split) / len(files) < 0.1  # about val_fraction of the files
    assert not any(is_validation_file(f, 0.0) for f in files)

    train_files, val_files = set(corpus.train.files), set(corpus.val.files)
    assert train_files and val_files and not train_files & val_files
    def usable(path: Path) -> bool:
        try:
            return bool(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            return False

    kept = {f.as_posix() for f in corpus_files(corpus_root) if usable(corpus_root / f)}
    assert "latin1.py" not in kept and "empty.py" not in kept
    assert train_files | val_files == kept
    # Same split and same bytes from a copy elsewhere: only the relative path decides.
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "installed.py").write_text("x = 1\n")
    shutil.copytree(corpus_root, tmp_path / "copy")
    shutil.copytree(tmp_path / "site-packages", tmp_path / "copy" / "site-packages")
    again = load_corpus(tmp_path / "copy", VAL_FRACTION)
    assert again.train.files == corpus.train.files and again.val.files == corpus.val.files
    assert torch.equal(again.train.tokens, corpus.train.tokens) and torch.equal(again.val.tokens, corpus.val.tokens)


def test_pack_rows_makes_each_document_its_own_sequence(corpus):
    stream, seq_len = corpus.train, 64
    rows = [r for r in range(stream.num_rows(seq_len)) if stream.doc_starts[r * seq_len + 1:(r + 1) * seq_len].any()]
    rows = rows[:3] + [0]  # rows crossing a file boundary, and the first row
    batch = pack_rows(stream, rows, seq_len)
    md, tokens, starts = batch.metadata, stream.tokens.tolist(), stream.doc_starts.tolist()
    # Naive reference: walk the rows token by token.
    ids, positions, targets, cu = [], [], [], [0]
    for r in rows:
        for i in range(r * seq_len, (r + 1) * seq_len):
            if i > r * seq_len and starts[i]:
                cu.append(len(ids))
            positions.append(0 if i == r * seq_len or starts[i] else positions[-1] + 1)
            ids.append(tokens[i])
            targets.append(IGNORE_INDEX if starts[i + 1] else tokens[i + 1])
        cu.append(len(ids))
    assert md.input_ids.tolist() == ids and md.positions.tolist() == positions
    assert batch.targets.tolist() == targets and md.cu_seqlens_q.tolist() == cu
    assert md.seq_lens.tolist() == [b - a for a, b in zip(cu, cu[1:])] and len(cu) > len(rows) + 1
    assert md.prefill_only and md.slot_mapping.eq(-1).all()
    # Row order: a function of (seed, step) only, each epoch a permutation.
    epoch = torch.cat([train_rows(10, 5, s, seed=3) for s in range(2)])
    assert sorted(epoch.tolist()) == list(range(10))
    assert torch.equal(train_rows(10, 5, 1, seed=3), epoch[5:])
    assert not torch.equal(train_rows(10, 5, 0, seed=4), epoch[:5])


# --- training -------------------------------------------------------------------------------

def test_tiny_training_loss_falls(tmp_path, corpus_root, corpus):
    config = tiny_run(tmp_path, corpus_root, steps=30, eval_every=15)
    result = train(config, corpus)
    losses = result.losses
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert losses[0] > math.log(256) - 0.3  # starts near uniform over 256 bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    (s1, first), (s2, last) = result.val_history
    assert (s1, s2) == (15, 30) and last < first < 8.0  # bits per byte, uniform = 8
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["val_bits_per_byte"] == last and summary["steps"] == 30
    card = json.loads((tmp_path / "model" / "training.json").read_text())
    assert card == {key: value for key, value in summary.items() if key != "export"} and "export" in summary
    data = summary["data"]
    assert (data["train_files"], data["train_tokens"]) == (len(corpus.train.files), corpus.train.num_tokens)
    assert data["epochs"] == pytest.approx(30 * config.batch_rows * config.seq_len / corpus.train.num_tokens)
    # The exported model is the last checkpoint's float32 weights rounded to bf16.
    exported = load_diffllama(tmp_path / "model").state_dict()
    final = load_diffllama(tmp_path / "checkpoints" / "step_000030").state_dict()
    assert all(torch.equal(exported[k], v.bfloat16().float()) for k, v in final.items())
    assert not all(torch.equal(final[k], v) for k, v in build_random_model(config.model).state_dict().items())


def test_bf16_mixed_precision_keeps_float32_master_weights(tmp_path, corpus_root, corpus):
    fp32 = train(tiny_run(tmp_path / "fp32", corpus_root, steps=3), corpus).losses
    trainer = Trainer(tiny_run(tmp_path / "bf16", corpus_root, steps=3, precision="bf16"), corpus)
    bf16 = trainer.run().losses
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert bf16 != fp32 and all(abs(a - b) < 0.05 for a, b in zip(bf16, fp32))


@pytest.mark.slow
def test_compiled_training_matches_eager_with_no_graph_break_or_recompile(tmp_path, corpus_root):
    """torch.compile(fullgraph=True) of forward + backward; one layer to keep compiling short,
    no validation split so only the training graph compiles. Files of 40 to 300 bytes, so the
    number of varlen sequences changes from step to step."""
    text = (stdlib_root() / "json" / "decoder.py").read_text(encoding="utf-8")
    root = tmp_path / "small"
    root.mkdir()
    start = 0
    for i in range(60):
        size = 40 + (i * 97) % 260
        (root / f"f{i}.py").write_text(text[start:start + size], encoding="utf-8")
        start += size
    data = load_corpus(root, 0.0)
    model = dataclasses.replace(tiny_config(), num_hidden_layers=1)
    runs = {}
    for compiled in (False, True):
        trainer = Trainer(tiny_run(tmp_path / str(compiled), root, model=model, steps=4, compile=compiled,
                                   val_fraction=0.0), data)
        runs[compiled] = trainer.run().losses, trainer.stats
    assert len({trainer.batch(s).metadata.num_seqs for s in range(4)}) > 1  # sequence counts changed
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-4, atol=1e-5)
    stats = runs[True][1]
    assert (stats.graphs_compiled, stats.graph_breaks, stats.recompiles) == (1, 0, 0)


@pytest.mark.parametrize("differential", [True, False], ids=["diff", "plain"])
def test_resumed_run_has_the_losses_of_an_uninterrupted_one(tmp_path, corpus_root, corpus, differential):
    straight = train(tiny_run(tmp_path / "a", corpus_root, differential=differential, checkpoint_every=4,
                              eval_every=4), corpus)
    checkpoint = tmp_path / "a" / "checkpoints" / "step_000004"
    resumed = train(tiny_run(tmp_path / "b", corpus_root, differential=differential, checkpoint_every=4,
                             eval_every=4, resume=checkpoint), corpus)
    assert resumed.start_step == 4 and len(resumed.losses) == 4
    assert resumed.losses == straight.losses[4:]
    assert resumed.val_history == straight.val_history
    a, b = (load_file(tmp_path / run / "checkpoints" / "step_000008" / "model.safetensors") for run in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = train(tiny_run(tmp_path / "c", corpus_root, differential=differential, seed=1), corpus)
    assert other.losses[4:] != straight.losses[4:]  # the equality above is not trivially true


def test_run_stopped_by_max_seconds_continues_with_resume_latest(tmp_path, corpus_root, corpus):
    straight = train(tiny_run(tmp_path / "a", corpus_root, eval_every=4), corpus)
    stopped = train(tiny_run(tmp_path / "b", corpus_root, eval_every=4, max_seconds=1e-9), corpus)
    assert not stopped.finished and stopped.losses == straight.losses[:1]
    assert not (tmp_path / "b" / "model").exists()
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["finished"] is False and summary["steps_done"] == 1
    assert summary["tokens_trained"] == summary["tokens_per_step"]  # what ran, not the schedule
    rest = train(tiny_run(tmp_path / "b", corpus_root, eval_every=4, resume="latest"), corpus)
    assert rest.finished and rest.start_step == 1 and rest.losses == straight.losses[1:]
    assert rest.val_history == straight.val_history and (tmp_path / "b" / "model" / "config.json").is_file()
    # Resuming the finished run trains nothing and keeps its summary.
    written = (tmp_path / "b" / "summary.json").read_text()
    again = train(tiny_run(tmp_path / "b", corpus_root, eval_every=4, resume="latest"), corpus)
    assert again.finished and again.losses == [] and again.summary == json.loads(written)
    assert (tmp_path / "b" / "summary.json").read_text() == written
    assert again.summary["final_train_loss"] == rest.losses[-1]
    fresh = tiny_run(tmp_path / "c", corpus_root, resume="latest")  # nothing to resume: a fresh start
    assert fresh.resume is None


def test_learning_rate_warms_up_then_decays_to_the_floor(tmp_path):
    config = TrainConfig(tmp_path, model=tiny_config(), steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    rates = [learning_rate(s, config) for s in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(rates[:10], rates[1:10]))
    assert all(a >= b for a, b in zip(rates[10:], rates[11:]))
    assert rates[-1] == pytest.approx(1e-4) and rates[55] == pytest.approx(5.5e-4, rel=0.02)


# --- save_diffllama -------------------------------------------------------------------------

BASE = DiffLlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=64,
                       bos_token_id=None, eos_token_id=None, lambda_std_dev=0.3)
CONFIGS = {
    "gqa": BASE,
    "mha-tied-bias": dataclasses.replace(BASE, num_key_value_heads=8, tie_word_embeddings=True, attention_bias=True,
                                         eos_token_id=[3, 5], rope_theta=5e5),
    "ours-only-fields": dataclasses.replace(BASE, kv_sharing={2: 0}, sliding_window=6, subln_affine=True,
                                            lambda_init=0.5),
}
PROMPTS = [[1, 5, 9, 2, 60, 33, 7, 8, 12], [7, 3], [4] * 11]


def _random_model(config: DiffLlamaConfig, seed: int = 2):
    model = build_random_model(config, seed=seed)
    with torch.no_grad():  # build_random_model zeroes biases and sets norms to one
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return model


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    """Every prompt token's logits, K/V through a paged cache (so KV-sharing layers run)."""
    c = model.config
    caches = [(torch.zeros(8, 16, c.num_key_value_heads, c.head_dim), torch.zeros(8, 16, c.num_key_value_heads,
                                                                                  c.head_dim))
              for _ in range(model.num_cache_layers)]
    md = build_metadata([SequenceChunk(p, 0, [i]) for i, p in enumerate(PROMPTS)], 16, 1)
    return model(md, caches, all_logits=True)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_diffllama_round_trips_through_our_loader(tmp_path, name):
    model = _random_model(CONFIGS[name])
    save_diffllama(model, tmp_path / "m")
    loaded = load_diffllama(tmp_path / "m")
    assert loaded.config == model.config
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert torch.equal(_logits(loaded), _logits(model))
    # bf16 on disk: the same tensors rounded, half the bytes.
    save_diffllama(model, tmp_path / "bf16", dtype=torch.bfloat16)
    small = load_diffllama(tmp_path / "bf16", dtype=torch.bfloat16)
    assert all(torch.equal(small.state_dict()[k], v.bfloat16()) for k, v in ours.items())
    size = {d: (tmp_path / d / "model.safetensors").stat().st_size for d in ("m", "bf16")}
    assert size["bf16"] < 0.55 * size["m"]


@pytest.mark.parametrize("name", ["gqa", "mha-tied-bias"])
def test_transformers_reads_save_diffllama(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    model = _random_model(CONFIGS[name])
    save_diffllama(model, tmp_path)
    hf = transformers.DiffLlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert hf.config.num_key_value_heads == model.config.num_key_value_heads
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    ours = _logits(model)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_save_diffllama_refuses_what_it_cannot_write(tmp_path):
    plain = build_random_model(BASE, differential=False)
    with pytest.raises(ValueError, match="differential=False"):
        save_diffllama(plain, tmp_path)
    with pytest.raises(TypeError, match="model must be a DiffLlamaForCausalLM"):
        save_diffllama(torch.nn.Linear(2, 2), tmp_path)
    model = build_random_model(BASE)
    with pytest.raises(TypeError, match="dtype"):
        save_diffllama(model, tmp_path, dtype=torch.int8)
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="not a directory"):
        save_diffllama(model, tmp_path / "file")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        save_diffllama(model, tmp_path / "nan")


# --- arguments ------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, error", [
    ("steps", 0, ValueError), ("steps", 2.5, TypeError), ("batch_rows", True, TypeError),
    ("seq_len", 5000, ValueError), ("warmup_steps", 8, ValueError), ("lr", 0.0, ValueError),
    ("lr", float("nan"), ValueError), ("lr", "1e-3", TypeError), ("betas", (0.9,), TypeError),
    ("betas", (0.9, 1.0), ValueError), ("device", "tpu", ValueError), ("precision", "fp8", ValueError),
    ("export_dtype", "int8", ValueError), ("val_fraction", 1.0, ValueError), ("model", "tiny", TypeError),
    ("model", dataclasses.replace(tiny_config(), vocab_size=100), ValueError), ("out_dir", 3, TypeError),
    ("compile", "yes", TypeError), ("peak_flops", -1.0, ValueError), ("eval_every", -1, ValueError),
    ("max_seconds", 0, ValueError), ("resume", 5, TypeError),
])
def test_bad_train_settings_raise_naming_the_field(tmp_path, corpus_root, field, value, error):
    values = {"out_dir": tmp_path, field: value}
    with pytest.raises(error, match=rf"^{field} must be"):
        tiny_run(values.pop("out_dir"), corpus_root, **values)


def test_bad_run_inputs_raise_clear_errors(tmp_path, corpus_root, corpus):
    with pytest.raises(ValueError, match="batch_rows=100000 exceeds"):
        Trainer(tiny_run(tmp_path, corpus_root, batch_rows=100000), corpus)
    with pytest.raises(ValueError, match="corpus was read from .* with val_fraction=0.2, but the config"):
        Trainer(tiny_run(tmp_path, corpus_root, val_fraction=0.3), corpus)
    with pytest.raises(ValueError, match=r"resume: .* \(no trainer_state.pt\)"):
        Trainer(tiny_run(tmp_path, corpus_root, resume=tmp_path), corpus)
    train(tiny_run(tmp_path / "a", corpus_root, steps=2, warmup_steps=1), corpus)
    with pytest.raises(ValueError, match=r"holds checkpoints of an earlier run \(step_000002\): continue it"):
        Trainer(tiny_run(tmp_path / "a", corpus_root, steps=3, warmup_steps=1), corpus)  # a fresh run into it
    with pytest.raises(ValueError, match=r"other settings: lr=0\.003 \(now 0\.001\)"):
        Trainer(tiny_run(tmp_path / "b", corpus_root, steps=2, warmup_steps=1, lr=1e-3,
                         resume=tmp_path / "a" / "checkpoints" / "step_000002"), corpus)
    wider = dataclasses.replace(tiny_config(), hidden_size=2 * tiny_config().hidden_size)
    with pytest.raises(ValueError, match=rf"other settings: model\.hidden_size={tiny_config().hidden_size} "
                                         rf"\(now {wider.hidden_size}\)$"):  # the one differing field, not the dicts
        Trainer(tiny_run(tmp_path / "b", corpus_root, steps=2, warmup_steps=1, model=wider,
                         resume=tmp_path / "a" / "checkpoints" / "step_000002"), corpus)
    with pytest.raises(ValueError, match="val_fraction"):
        is_validation_file("a.py", 1.5)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match="validation split without files"):
        load_corpus(corpus_root / "json", 0.01)
    with pytest.raises(ValueError, match="rows must be"):
        pack_rows(corpus.train, [corpus.train.num_rows(64)], 64)
    with pytest.raises(ValueError, match="seq_len must be"):
        pack_rows(corpus.train, [0], 0)


# --- command line ---------------------------------------------------------------------------

def test_cli_train_reports_throughput_and_the_model_generates(tmp_path, corpus_root, capsys):
    out = tmp_path / "run"
    args = ["train", "--tiny", "--steps", "6", "--batch-rows", "2", "--seq-len", "32", "--no-compile",
            "--no-progress", "--data-root", str(corpus_root), "--val-fraction", str(VAL_FRACTION),
            "--val-tokens", "256", "--peak-flops", "1e12", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "MFU" in printed and "bits/byte" in printed
    summary = json.loads((out / "summary.json").read_text())
    t = summary["throughput"]
    model = build_random_model(tiny_config())
    counts = parameter_counts(model)
    assert summary["parameters"] == counts and counts["total"] == sum(p.numel() for p in model.parameters())
    c = tiny_config()
    per_key = 3 * c.num_hidden_layers * 6 * c.num_attention_heads * c.head_dim  # differential: 6 Hq D per key
    assert t["flops_per_token"] == pytest.approx(6 * counts["matmul"] + per_key * t["mean_causal_keys_per_token"])
    assert t["flops_per_token_palm"] == pytest.approx(6 * counts["matmul"] + per_key * 32)
    assert 1 <= t["mean_causal_keys_per_token"] <= 16.5  # causal, within rows of 32
    assert t["tokens_per_s"] > 0 and t["mfu"] == pytest.approx(t["tokens_per_s"] * t["flops_per_token"] / 1e12)
    plain = flops_per_token(build_random_model(c, differential=False), 10.0)["attention_per_key"]
    assert plain == pytest.approx(per_key * 4 / 6)
    # The exported model is what `generate --model` takes.
    assert main(["generate", "--model", str(out / "model"), "--no-compile", "--json", "--prompt", "def f(",
                 "--max-new-tokens", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["completions"][0]["generated_ids"]) == 4
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--steps", "0"])
    assert exit_info.value.code == 2
    assert main(["train", "--tiny", "--steps", "2", "--warmup-steps", "5", "--out", str(tmp_path / "x")]) == 2
    assert "warmup_steps must be an int in [0, steps=2)" in capsys.readouterr().err
