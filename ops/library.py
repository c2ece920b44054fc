"""How the ``compiled_attn`` ops are registered: straight to the dispatcher.

``torch.library.custom_op`` routes every call through Python layers (an autograd wrapper
that runs even under ``no_grad``, a backend dispatcher, alias checks): about 100 µs a call
with grad mode on and 12 µs under ``no_grad`` on the CPU, against 3 µs for an op defined
with ``torch.library.Library`` whose kernels are bound per dispatch key (torch 2.13,
``profiling/bench_host.py``). So, as vLLM's ``direct_register_custom_op``, each op is
``define``d from an explicit schema and gets:

* the plain-PyTorch reference as its ``CompositeExplicitAutograd`` kernel (every device);
* a fake implementation (``register_fake``) that checks shapes and dtypes and gives the
  output shapes to FakeTensor tracing, ``torch.compile`` and ``torch.export``;
* faster kernels per dispatch key, bound with :func:`register_kernel` (``backends.py``);
* an autograd formula (``register_autograd``) where the op has a backward;
* optionally, its Triton launcher traced in place of the op under ``torch.compile``
  (:func:`register_traced_kernel`).

A call of ``torch.ops.compiled_attn.<name>`` then goes from the dispatcher to the kernel
of its device with nothing in between.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

LIBRARY = torch.library.Library("compiled_attn", "DEF")


def define_op(schema: str, reference: Callable, fake: Callable,
              tags: tuple[torch.Tag, ...] = ()) -> torch._ops.OpOverload:
    """Define ``compiled_attn::<schema>`` with ``reference`` as its kernel on every
    device and ``fake`` for tracing; returns the op's default overload."""
    name = schema.split("(", 1)[0]
    LIBRARY.define(schema, tags=tags)
    LIBRARY.impl(name, reference, "CompositeExplicitAutograd")
    torch.library.register_fake(f"compiled_attn::{name}", fake, lib=LIBRARY)
    return getattr(torch.ops.compiled_attn, name).default


def register_kernel(op: torch._ops.OpOverload, dispatch_key: str, kernel: Callable) -> None:
    """Bind ``kernel`` (called with the schema's arguments as they are) as ``op``'s
    implementation for ``dispatch_key`` (e.g. ``"CUDA"``)."""
    LIBRARY.impl(op._schema.name.split("::")[1], kernel, dispatch_key)


def _static_cuda(args) -> bool:
    """Every tensor argument is on CUDA with plain-int sizes and strides (no symbols)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return all(t.is_cuda and all(type(n) is int for n in (*t.shape, *t.stride())) for t in tensors)


def register_traced_kernel(op: torch._ops.OpOverload, launcher: Callable,
                           traced_launches: Callable[[], contextlib.AbstractContextManager],
                           opaque: Callable[..., bool] = lambda *args: False) -> None:
    """Let AOTAutograd trace ``launcher`` in place of ``op`` (as ``torch.library.triton_op``
    does) when every tensor argument is on CUDA with static shapes: the launches it records
    inside ``traced_launches()`` (``wrap_triton`` calls) replace the op in the graph that
    Inductor compiles. Otherwise, when ``opaque(*args)`` (the CUDA kernel would not launch
    our Triton kernels), and under ``torch.export`` (which keeps custom ops whole), the op
    stays opaque."""

    def decompose(mode, func, types, args, kwargs):
        # imported here, while tracing: at import time it would load torch._dynamo (about 1 s)
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        if (custom_triton_ops_decomposition_disabled() or not _static_cuda(args) or opaque(*args)
                or any(t not in (torch.Tensor, FunctionalTensor) and not issubclass(t, FakeTensor) for t in types)):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode, traced_launches():
            return launcher(*args, **kwargs)

    torch.library.register_torch_dispatch(op, FunctionalTensorMode, decompose, lib=LIBRARY)
