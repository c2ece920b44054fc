"""Test-session setup shared by every test module.

Without a CUDA GPU, Triton kernels run on CPU tensors through Triton's interpreter, which
is chosen when ``triton.jit`` decorates a kernel: ``TRITON_INTERPRET=1`` has to be set here,
before any test module imports Triton (through ``compiled_attn``). With a GPU the kernels
compile for it and the variable stays unset.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
