"""nn.Modules built on the ``compiled_attn`` ops."""

from .attention import Attention
from .differential import DifferentialAttention, lambda_init_for_depth
from .linear import linear
from .norm import RMSNorm
from .rotary import RotaryEmbedding

__all__ = ["Attention", "DifferentialAttention", "RMSNorm", "RotaryEmbedding", "lambda_init_for_depth", "linear"]
