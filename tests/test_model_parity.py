"""Our DiffLlama against Hugging Face transformers' own, on saved random checkpoints."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is needed for the parity tests")

from compiled_attn.engine import Engine  # noqa: E402
from compiled_attn.metadata import SequenceChunk, build_metadata  # noqa: E402
from compiled_attn.models import load_diffllama  # noqa: E402
from compiled_attn.sampling import SamplingParams  # noqa: E402

VOCAB = 320
PROMPT_LENS = (7, 1, 23, 16)


@pytest.fixture(scope="module", params=[(8, 4), (8, 8)], ids=["gqa", "mha"])
def checkpoint(request, tmp_path_factory):
    """A random HF DiffLlama saved to disk, with the HF model kept for reference."""
    heads, kv_heads = request.param
    torch.manual_seed(1234 + kv_heads)
    config = transformers.DiffLlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, lambda_std_dev=0.3,
    )
    hf_model = transformers.DiffLlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp(f"diffllama_{heads}_{kv_heads}")
    hf_model.save_pretrained(path)
    return hf_model, path


def _prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def _hf_logits(hf_model, prompts):
    return torch.cat([hf_model(torch.tensor([p])).logits[0] for p in prompts])


def _relative_max_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@torch.no_grad()
def test_varlen_prefill_logits_match_transformers(checkpoint):
    hf_model, path = checkpoint
    model = load_diffllama(path)
    prompts = _prompts(0)
    ref = _hf_logits(hf_model, prompts)
    md = build_metadata([SequenceChunk(p, 0, [i]) for i, p in enumerate(prompts)], 32, 1)
    assert md.prefill_only
    assert _relative_max_error(model(md, None, all_logits=True), ref) < 1e-4


@torch.no_grad()
def test_chunked_prefill_over_the_paged_cache_matches_transformers(checkpoint):
    """First halves as a prefill, second halves as chunks on top of the cache (paged op)."""
    hf_model, path = checkpoint
    model = load_diffllama(path)
    engine = Engine(model, compile=False, block_size=16, num_blocks=16)
    prompts = _prompts(1)
    tables = [engine.kv_cache.allocator.allocate(i, len(p)) for i, p in enumerate(prompts)]
    split = [max(1, len(p) // 2) for p in prompts]
    first = build_metadata([SequenceChunk(p[:s], 0, t) for p, s, t in zip(prompts, split, tables)], 16, 2)
    second_chunks = [SequenceChunk(p[s:], s, t) for p, s, t in zip(prompts, split, tables) if len(p) > s]
    second = build_metadata(second_chunks, 16, 2)
    assert not second.prefill_only
    head = model(first, engine.kv_cache.layers, all_logits=True)
    tail = model(second, engine.kv_cache.layers, all_logits=True)
    ref = _hf_logits(hf_model, prompts)
    starts = [0]
    for p in prompts:
        starts.append(starts[-1] + len(p))
    ours_by_seq, h, t = [], 0, 0
    for p, s in zip(prompts, split):
        ours_by_seq.append(head[h:h + s])
        h += s
        ours_by_seq.append(tail[t:t + len(p) - s])
        t += len(p) - s
    assert _relative_max_error(torch.cat(ours_by_seq), ref) < 1e-4


@torch.no_grad()
def test_greedy_generation_matches_transformers_for_32_tokens(checkpoint):
    hf_model, path = checkpoint
    engine = Engine(load_diffllama(path), compile=False, block_size=16)
    prompts = _prompts(2)
    completions, _ = engine.generate(prompts, SamplingParams(max_new_tokens=32))
    # A degenerate model (one token repeated) would make the comparison weak.
    assert len({t for c in completions for t in c.output_ids}) >= 8
    for prompt, completion in zip(prompts, completions):
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                min_new_tokens=32, pad_token_id=0)
        assert completion.output_ids == ref[0, len(prompt):].tolist()
