"""`compiled-attn generate` (eager only; the compiled CLI is tested with the compile tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiled_attn.cli import main
from compiled_attn.engine import Engine
from compiled_attn.models import DEFAULT_MODEL_DIR, build_random_model, load_diffllama, random_model_config
from compiled_attn.sampling import SamplingParams
from compiled_attn.tokenizer import ByteTokenizer

BASE = ["generate", "--no-compile", "--json"]


def run_json(capsys, *args: str) -> dict:
    assert main([*BASE, *args]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def test_prompt_ids_json(capsys):
    result = run_json(capsys, "--max-new-tokens", "4", "--prompt-ids", "1,2,3", "--prompt-ids", "7,8")
    assert result["model"] == "embedded-default"
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    completions = result["completions"]
    assert [c["prompt_ids"] for c in completions] == [[1, 2, 3], [7, 8]]
    for c in completions:
        assert len(c["generated_ids"]) == 4
        assert all(0 <= t < 256 for t in c["generated_ids"])
        assert c["text"] == ByteTokenizer().decode(c["generated_ids"])
        assert c["finish_reason"] == "length"
    t = result["timings"]
    assert t["prefill_tokens"] == 5 and t["decode_tokens"] == 6
    assert t["overlapped_steps"] == 2  # decode steps 2 and 3 launched before their predecessor was read
    assert t["prefill_tokens_per_s"] > 0 and t["decode_tokens_per_s"] > 0
    assert t["load_seconds"] >= 0 and t["compile_seconds"] == 0.0
    assert result["compile"] is None
    # The CLI's tokens are the engine's greedy tokens on the embedded (trained) model.
    expected, _ = Engine(load_diffllama(DEFAULT_MODEL_DIR), compile=False, max_model_len=64).generate(
        [[1, 2, 3], [7, 8]], SamplingParams(max_new_tokens=4))
    assert [c["generated_ids"] for c in completions] == [c.output_ids for c in expected]


def test_random_model_is_the_seeded_random_model(capsys):
    result = run_json(capsys, "--random-model", "--seed", "5", "--max-new-tokens", "4", "--prompt-ids", "1,2,3")
    assert result["model"] == "random (seed 5)"
    model = build_random_model(random_model_config(), seed=5)
    expected, _ = Engine(model, compile=False, max_model_len=64).generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    assert result["completions"][0]["generated_ids"] == expected[0].output_ids
    with pytest.raises(SystemExit) as exit_info:  # argparse: --model and --random-model exclude each other
        main([*BASE, "--random-model", "--model", "x"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_no_async_decode_gives_the_same_tokens_without_overlap(capsys):
    args = ("--max-new-tokens", "5", "--prompt-ids", "1,2,3", "--prompt-ids", "7,8")
    overlapped = run_json(capsys, *args)
    synchronous = run_json(capsys, *args, "--no-async-decode")
    assert overlapped["timings"]["overlapped_steps"] == 3 and synchronous["timings"]["overlapped_steps"] == 0
    assert synchronous["completions"] == overlapped["completions"]


def test_text_prompts_are_utf8_bytes(capsys):
    result = run_json(capsys, "--max-new-tokens", "2", "--prompt", "héllo", "--prompt", "a b")
    assert [c["prompt_ids"] for c in result["completions"]] == [list("héllo".encode()), [97, 32, 98]]
    assert [len(c["generated_ids"]) for c in result["completions"]] == [2, 2]


def test_prompt_file(capsys, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("first line\n\n  \nsecond ✓\n", encoding="utf-8")
    result = run_json(capsys, "--max-new-tokens", "1", "--prompt-file", str(path))
    assert [c["prompt_ids"] for c in result["completions"]] == [
        list(b"first line"), list("second ✓".encode())]


def test_empty_prompt_file_is_an_error(capsys, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n  \n")
    assert main([*BASE, "--prompt-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert "compiled-attn: error:" in err and "no non-empty line" in err


def test_default_prompts(capsys):
    result = run_json(capsys, "--max-new-tokens", "1")
    assert [c["prompt_ids"] for c in result["completions"]] == [
        list(b"def fibonacci(n):"), list(b"class Stack:\n    def push(self, item):")]


def test_sampling_is_reproducible_with_seed(capsys):
    prompts = ("--max-new-tokens", "6", "--prompt-ids", "5,6,7", "--prompt-ids", "9")

    def ids(*extra):
        return [c["generated_ids"] for c in run_json(capsys, *prompts, *extra)["completions"]]

    a = ids("--temperature", "0.8", "--seed", "3")
    assert a == ids("--temperature", "0.8", "--seed", "3")
    assert a != ids("--temperature", "0", "--seed", "3")  # same model, greedy
    assert a != ids("--temperature", "0.8", "--seed", "4")


def test_top_p_tiny_is_greedy(capsys):
    ids = ("--max-new-tokens", "5", "--prompt-ids", "1,2")
    nucleus = run_json(capsys, *ids, "--temperature", "1.0", "--top-p", "0.000001")
    greedy = run_json(capsys, *ids)
    assert nucleus["completions"][0]["generated_ids"] == greedy["completions"][0]["generated_ids"]


def save_tiny_hf(path: Path, vocab_size: int = 256) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.DiffLlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    transformers.DiffLlamaForCausalLM(config).save_pretrained(path)


def test_model_dir_without_tokenizer_decodes_bytes(capsys, tmp_path):
    save_tiny_hf(tmp_path)
    result = run_json(capsys, "--model", str(tmp_path), "--max-new-tokens", "3", "--prompt", "hi")
    assert result["model"] == str(tmp_path)
    (c,) = result["completions"]
    assert c["prompt_ids"] == [104, 105]
    assert len(c["generated_ids"]) == 3
    assert c["text"] == ByteTokenizer().decode(c["generated_ids"])
    # Same tokens as the engine on the loaded model.
    from compiled_attn.models import load_diffllama
    expected, _ = Engine(load_diffllama(tmp_path), compile=False).generate(
        [[104, 105]], SamplingParams(max_new_tokens=3))
    assert c["generated_ids"] == expected[0].output_ids


def test_model_dir_with_tokenizer_json(capsys, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    save_tiny_hf(tmp_path, vocab_size=16)
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, **{f"w{i}": i for i in range(3, 16)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    result = run_json(capsys, "--model", str(tmp_path), "--max-new-tokens", "2", "--prompt", "hello world")
    (c,) = result["completions"]
    assert c["prompt_ids"] == [1, 2]
    assert c["text"] == tok.decode(c["generated_ids"])


def test_text_output(capsys, tmp_path):
    save_tiny_hf(tmp_path)
    assert main(["generate", "--no-compile", "--model", str(tmp_path), "--max-new-tokens", "2",
                 "--prompt", "ab"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[0] 'ab' -> ") and lines[0].endswith("(2 tokens, length)")
    assert lines[1].startswith("prefill: 2 tokens, ") and lines[1].endswith(" tokens/s")
    assert lines[2].startswith("decode:  1 tokens, ") and lines[2].endswith(" tokens/s")
    assert lines[3].startswith("warm-up: ") and lines[3].endswith(" s before the first request")
    assert len(lines) == 4  # no compile line when eager


@pytest.mark.parametrize(
    "setup, match",
    [
        ("missing", r"no-model-here does not exist"),
        ("empty", r"has no config\.json"),
        ("llama", r"model_type='llama'"),
        ("no-weights", r"model\.safetensors"),
    ],
)
def test_bad_model_dir_exits_2(capsys, tmp_path, setup, match):
    path = tmp_path / "no-model-here"
    if setup != "missing":
        path.mkdir()
    if setup == "llama":
        (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if setup == "no-weights":
        (path / "config.json").write_text(json.dumps({"model_type": "diffllama", "vocab_size": 256,
                                                      "hidden_size": 64, "num_hidden_layers": 1,
                                                      "num_attention_heads": 4}))
    assert main([*BASE, "--model", str(path), "--max-new-tokens", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("compiled-attn: error: ")
    assert __import__("re").search(match, captured.err), captured.err


def test_out_of_vocab_prompt_ids_exit_2(capsys):
    assert main([*BASE, "--max-new-tokens", "1", "--prompt-ids", "1,300"]) == 2
    assert r"outside [0, 256)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, match",
    [
        (["--max-new-tokens", "5000"], "exceeds max_model_len=4096"),
        (["--memory-snapshot", "snap.pickle"], "--memory-snapshot needs --profile DIR and --device cuda"),
    ],
)
def test_bad_values_exit_2(capsys, args, match):
    assert main([*BASE, "--prompt-ids", "1,2", *args]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("compiled-attn: error: ") and match in captured.err


def test_bfloat16(capsys):
    result = run_json(capsys, "--dtype", "bfloat16", "--max-new-tokens", "3", "--prompt-ids", "1,2")
    assert result["dtype"] == "bfloat16"
    assert len(result["completions"][0]["generated_ids"]) == 3


def test_a_prompt_that_cannot_fit_the_cache_is_a_clean_error(capsys):
    """A request needing more blocks than the whole cache: exit 2, one line on stderr."""
    args = [*BASE, "--num-blocks", "1", "--max-new-tokens", "2", "--prompt-ids", ",".join(["1"] * 20)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("compiled-attn: error: ") and "needs 2 blocks of 16" in err, err


def test_more_prompts_than_the_cache_holds_at_once_run_in_turn(capsys, tmp_path):
    """The cache holds 8 sequences of max_model_len; 9 long prompts still all complete."""
    save_tiny_hf(tmp_path)  # max_position_embeddings=32 -> 16 blocks of 16 tokens
    capsys.readouterr()  # drop the save's progress bar
    args = [*BASE, "--model", str(tmp_path), "--max-new-tokens", "2"]
    for _ in range(9):
        args += ["--prompt-ids", ",".join(["1"] * 20)]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert [len(c["generated_ids"]) for c in result["completions"]] == [2] * 9


def test_cuda_without_gpu_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main([*BASE, "--device", "cuda", "--max-new-tokens", "1"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, match",
    [
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", ","], "at least one id"),
        (["--prompt-ids", "1", "--prompt", "hi"], "not allowed with"),
        (["--temperature", "hot"], "argument --temperature: must be a finite number >= 0 (0 = greedy), got 'hot'"),
        (["--dtype", "float64"], "invalid choice"),
    ],
)
def test_bad_arguments_are_argparse_errors(capsys, args, match):
    with pytest.raises(SystemExit) as info:
        main([*BASE, *args])
    assert info.value.code == 2
    assert match in capsys.readouterr().err


def test_missing_subcommand_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_console_script_subprocess():
    script = Path(sys.executable).parent / "compiled-attn"
    assert script.exists(), f"console script not installed next to {sys.executable}"
    proc = subprocess.run([str(script), "generate", "--no-compile", "--max-new-tokens", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("[0] 'def fibonacci(n):' -> ") and "(2 tokens, length)" in lines[0]
    assert lines[1].startswith("[1] 'class Stack:\\n    def push(self, item):' -> ")
    assert any(line.startswith("prefill: ") and line.endswith("tokens/s") for line in lines)
    assert any(line.startswith("decode: ") and line.endswith("tokens/s") for line in lines)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--block-size", "0"], "argument --block-size: must be an int >= 1, got 0"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens: must be an int >= 1, got 0"),
        (["--max-new-tokens", "abc"], "argument --max-new-tokens: must be an int >= 1, got 'abc'"),
        (["--max-batch-size", "0"], "argument --max-batch-size: must be an int >= 1"),
        (["--num-blocks", "0"], "argument --num-blocks: must be an int >= 1"),
        (["--profile-steps", "0"], "argument --profile-steps: must be an int >= 1"),
        (["--seed", "-1"], r"argument --seed: must be an int in \[0, 2\*\*63\), got -1"),
        (["--seed", str(1 << 63)], "argument --seed: must be an int in"),
        (["--top-p", "0"], r"argument --top-p: must be a number in \(0, 1\], got 0"),
        (["--top-p", "1.5"], r"argument --top-p: must be a number in \(0, 1\], got 1.5"),
        (["--temperature", "-1"], r"argument --temperature: must be a finite number >= 0 \(0 = greedy\), got -1"),
        (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
        (["--temperature", "inf"], "argument --temperature: must be a finite number >= 0"),
        (["--prompt-ids", "1,,2"], "argument --prompt-ids: --prompt-ids takes comma-separated integers"),
    ],
)
def test_bad_option_values_are_argparse_errors_naming_the_option(capsys, args, match):
    with pytest.raises(SystemExit) as exit_info:
        main([*BASE, *args])
    assert exit_info.value.code == 2
    assert __import__("re").search(match, capsys.readouterr().err)


@pytest.mark.parametrize(
    "args, sizes",
    [
        (["--max-num-batched-tokens", "8"], "(16) and >= --max-batch-size (128, a token for each running request), got 8"),
        (["--max-num-batched-tokens", "64"], "(16) and >= --max-batch-size (128, a token for each running request), got 64"),
        (["--max-num-batched-tokens", "16", "--max-batch-size", "17"],
         "(16) and >= --max-batch-size (17, a token for each running request), got 16"),
        (["--max-num-batched-tokens", "31", "--max-batch-size", "4", "--block-size", "32"],
         "(32) and >= --max-batch-size (4, a token for each running request), got 31"),
    ],
)
def test_a_bad_token_budget_names_the_flags_before_the_model_loads(capsys, monkeypatch, args, sizes):
    """Below a block or below one token per running sequence (vLLM's rule): an error naming
    the flags, not the engine's ``max_num_batched_tokens``/``max_num_seqs``, before the model loads."""
    import compiled_attn.cli as cli

    def load_diffllama(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(cli, "load_diffllama", load_diffllama)
    assert main([*BASE, "--prompt-ids", "1,2", *args]) == 2
    assert capsys.readouterr().err == f"compiled-attn: error: --max-num-batched-tokens must be >= --block-size {sizes}\n"


def test_a_token_budget_of_max_batch_size_runs(capsys):
    result = run_json(capsys, "--max-num-batched-tokens", "16", "--max-batch-size", "16", "--max-new-tokens", "2",
                      "--prompt-ids", ",".join(["5"] * 40))  # a 40-token prompt in chunks of 16
    assert len(result["completions"][0]["generated_ids"]) == 2


def test_unreadable_inputs_are_clean_errors(capsys, tmp_path):
    assert main([*BASE, "--prompt-file", str(tmp_path)]) == 2  # a directory
    assert "--prompt-file" in capsys.readouterr().err
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    assert main([*BASE, "--prompt-file", str(binary)]) == 2
    assert "cannot read it as UTF-8" in capsys.readouterr().err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    assert main([*BASE, "--model", str(model)]) == 2
    assert "config.json is not valid JSON" in capsys.readouterr().err


def test_importing_the_library_and_cli_leaves_dynamo_and_the_bench_harness_unloaded():
    """``import compiled_attn`` (and the CLI module) loads neither Dynamo nor Inductor (about
    1 s of a short eager run; ``torch.compile`` loads them when a function is compiled), nor
    the benchmark harness (``compiled-attn bench`` imports it)."""
    modules = ("torch._dynamo", "torch._inductor", "torch.export._trace", "compiled_attn.benchmark",
               "compiled_attn.tp_benchmark")
    code = f"import sys, compiled_attn, compiled_attn.cli; print([m for m in {modules} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_an_unknown_option_is_an_error_of_its_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--no-compile", "--bogus", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: compiled-attn generate") and "unrecognized arguments: --bogus 1" in err


@pytest.mark.parametrize(
    "setup, match",
    [
        ("empty", "--profile needs a directory, got ''"),
        ("file", "--profile {file}: exists and is not a directory"),
        ("under-a-file", "--profile {file}/trace: cannot create the directory"),
    ],
)
def test_bad_profile_paths_exit_2_before_the_model_loads(capsys, tmp_path, monkeypatch, setup, match):
    import compiled_attn.cli as cli

    def load_diffllama(*args, **kwargs):
        raise ValueError("the model loaded")

    monkeypatch.setattr(cli, "load_diffllama", load_diffllama)
    file = tmp_path / "passwd"
    file.write_text("root:x:0:0\n")
    path = {"empty": "", "file": str(file), "under-a-file": str(file / "trace")}[setup]
    assert main([*BASE, "--max-new-tokens", "1", "--profile", path]) == 2
    assert capsys.readouterr().err.startswith("compiled-attn: error: " + match.format(file=file))
    assert file.read_text() == "root:x:0:0\n"
    assert main([*BASE, "--max-new-tokens", "1", "--profile", str(tmp_path / "a" / "b")]) == 2
    assert "the model loaded" in capsys.readouterr().err and (tmp_path / "a" / "b").is_dir()  # created first


def test_torchrun_processes_must_match_the_tensor_parallel_size(capsys, monkeypatch):
    """Two processes and the default --tensor-parallel-size 1 would print every output twice."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*BASE, "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel-size 1 needs as many processes, 2 running: pass --tensor-parallel-size 2" in err


def test_tensor_parallel_bench_errors_name_its_flags(capsys, monkeypatch):
    assert main(["bench", "--device", "cpu"]) == 2
    assert "bench --device cpu needs --tensor-parallel-size N > 1" in capsys.readouterr().err
    assert main(["bench", "--device", "cpu", "--tensor-parallel-size", "2"]) == 2
    assert "--tensor-parallel-size 2 needs as many processes, 1 running" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")  # (errors come before any process group)
    tp2 = ["bench", "--tensor-parallel-size", "2", "--device", "cpu"]
    assert main([*tp2, "--new-tokens", "1"]) == 2
    assert "--new-tokens >= 2" in capsys.readouterr().err
    assert main([*tp2, "--batch-sizes", "0"]) == 2
    assert "--batch-sizes >= 1" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--tensor-parallel-size", "2"]) == 2
        assert "needs CUDA GPUs; --device cpu runs a smoke test" in capsys.readouterr().err
