"""compiled_attn: differential-attention transformers that compile whole and replay as CUDA graphs."""

from . import ops  # registers torch.ops.compiled_attn.*

__version__ = "0.1.0"
