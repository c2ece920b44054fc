"""Model definitions and checkpoint loading."""

from .config import DiffLlamaConfig, random_model_config
from .diffllama import DiffLlamaForCausalLM, build_random_model
from .loader import DEFAULT_MODEL_DIR, load_diffllama
from .writer import save_diffllama

__all__ = ["DEFAULT_MODEL_DIR", "DiffLlamaConfig", "DiffLlamaForCausalLM", "build_random_model", "load_diffllama",
           "random_model_config", "save_diffllama"]
