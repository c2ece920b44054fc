"""Model definitions and checkpoint loading."""

from .config import DiffLlamaConfig, default_config
from .diffllama import DiffLlamaForCausalLM, build_random_model
from .loader import load_diffllama
from .writer import save_diffllama

__all__ = ["DiffLlamaConfig", "DiffLlamaForCausalLM", "build_random_model", "default_config", "load_diffllama",
           "save_diffllama"]
