"""How many of our Python frames a decode step passes from ``Engine.generate`` to the
attention kernel (gpt-fast's ``generate`` reaches SDPA in 7). A frame is a function of
``compiled_attn`` (``ops`` included); torch's dispatcher and ``nn.Module.__call__`` frames
in between are not ours and not counted."""

from __future__ import annotations

import traceback
from pathlib import Path

import compiled_attn
from compiled_attn.engine import Engine
from compiled_attn.models import build_random_model, random_model_config
from compiled_attn.ops import reference
from compiled_attn.sampling import SamplingParams

MAX_FRAMES = 10
"""``Engine.generate`` and the kernel included: generate, the engine step, the model
runner's decode launch, the decode step (what graphs capture), the model, a decoder layer,
the attention layer, its cache-and-op call (``attend``), the op's CPU implementation, the
kernel. (Under graph replay a step runs no Python frame below the model runner.)"""

PACKAGE = Path(compiled_attn.__file__).resolve().parent
OPS = Path(compiled_attn.ops.__file__).resolve().parent  # ops/ is linked in by the editable install


def _ours(frame: traceback.FrameSummary) -> bool:
    path = Path(frame.filename).resolve()
    return path.is_relative_to(PACKAGE) or path.is_relative_to(OPS)


def test_a_decode_step_reaches_the_attention_kernel_within_max_frames(monkeypatch):
    engine = Engine(build_random_model(random_model_config(), seed=0), compile=False)
    stacks = []
    kernel = reference.paged_attention

    def recording(*args, **kwargs):
        stacks.append([f for f in traceback.extract_stack()[:-1] if _ours(f)])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(reference, "paged_attention", recording)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=0.0))
    decode = [s for s in stacks if any(f.name == "launch_decode" for f in s)]
    assert decode, [[f.name for f in s] for s in stacks]
    stack = decode[-1]
    names = [f.name for f in stack]
    first = names.index("generate")
    chain = names[first:] + ["kernel"]
    assert len(chain) <= MAX_FRAMES, chain
