"""The README's "Bring your own model" block, run as it stands: a user's gpt-fast style
decoder (their embedding, MLP and loop; our ``DifferentialAttention`` over a static paged
cache) compiles with ``fullgraph=True``: tokens equal eager ones, one graph per step kind
(prefill, decode) however many tokens follow, and on a GPU ``mode="reduce-overhead"``
records its CUDA graphs (none skipped: the caches are static addresses)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> dict:
    """Run the first Python block of the README's "Bring your own model" section; its names."""
    section = README.read_text(encoding="utf-8").split("## Bring your own model", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    names: dict = {}
    exec(compile(code, f"{README}:bring-your-own-model", "exec"), names)
    return names


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_bring_your_own_model_compiles_once_per_step_kind():
    before = graphs()
    names = readme_example()  # generates 8 tokens compiled: a prefill and a decode graph
    assert graphs() - before == 2
    model, prompts, generate = names["model"], names["prompts"], names["generate"]
    before = graphs()
    compiled = generate(model, prompts, 64)  # 8x the tokens, blocks beyond the first run's: no new graph
    assert graphs() == before
    eager = generate(model, prompts, 64, compile=False)
    assert compiled.shape == (2, 64) and torch.equal(compiled, eager)
    assert len(set(eager.flatten().tolist())) > 1  # a real continuation, not one repeated id


@pytest.mark.slow
def test_several_models_in_one_process_with_compiled_function():
    """The README's remedy for Dynamo's shared budget: five models of other widths (more
    than the 8 graphs one ``torch.compile`` cache allows), each compiled with
    ``CompiledFunction``: no limit hit, tokens equal eager. The budget is Dynamo's, whatever
    the backend: the first model goes through Inductor, the others through ``aot_eager``
    (Inductor's code for them took ~40 of this test's 55 s on CI's machine)."""
    from compiled_attn.compile import CompiledFunction

    names = readme_example()
    prompts, generate = names["prompts"], names["generate"]
    for width in (32, 48, 64, 80, 96):  # 10 graphs
        torch.manual_seed(width)
        model = names["TinyDecoder"](dim=width).eval()
        backend = {} if width == 32 else {"backend": "aot_eager"}
        compiled = generate(model, prompts, 6, compiler=CompiledFunction, **backend)
        assert torch.equal(compiled, generate(model, prompts, 6, compile=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bring_your_own_model_reduce_overhead_records_cuda_graphs():
    names = readme_example()
    model, prompts, generate = names["model"].cuda(), names["prompts"].cuda(), names["generate"]
    skipped = counters["inductor"]["cudagraph_skips"]
    compiled = generate(model, prompts, 16, mode="reduce-overhead")
    assert counters["inductor"]["cudagraph_skips"] == skipped
    assert torch.equal(compiled, generate(model, prompts, 16, compile=False))
