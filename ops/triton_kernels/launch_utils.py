"""Small host-side helpers shared by the kernel launchers."""

import contextlib
import functools
import threading
from typing import Callable, Hashable, Iterator

import torch
from torch.library import wrap_triton
from triton import knobs

_TRACE = threading.local()


@contextlib.contextmanager
def traced_launches() -> Iterator[None]:
    """While active (on this thread), launchers are being traced by AOTAutograd with
    functional tensors: :class:`CachedLauncher` records each launch as a
    ``torch.library.wrap_triton`` call, so Inductor compiles the kernel and launches it
    from its generated code, and nothing reads a tensor's address."""
    previous = getattr(_TRACE, "active", False)
    _TRACE.active = True
    try:
        yield
    finally:
        _TRACE.active = previous


def tracing_launches() -> bool:
    """Whether :func:`traced_launches` is active on this thread."""
    return getattr(_TRACE, "active", False)


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()


def device_guard(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``tensor``'s GPU current while a kernel launches (Triton launches on the
    current device); nothing when it already is, or for CPU tensors (the interpreter)."""
    if not tensor.is_cuda or tensor.get_device() == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(tensor.device)


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the CPU (the Triton interpreter
    runs one program at a time)."""
    if device.type != "cuda":
        return 1
    return _cuda_multiprocessors(torch.cuda.current_device() if device.index is None else device.index)


def alignments(tensors) -> tuple[int, ...]:
    """Each tensor's address modulo 16 bytes: Triton specializes a compiled variant on
    whether a pointer argument is 16-byte aligned, so launch keys carry it. Empty while
    launches are traced (no addresses; nothing is cached then)."""
    if tracing_launches():
        return ()
    return tuple([t.data_ptr() % 16 for t in tensors])


class BoundedCache(dict):
    """A dict that forgets its oldest entry beyond ``maxsize`` entries (launch specs and
    compiled variants keyed by shapes: a server sees unboundedly many prefill shapes)."""

    def __init__(self, maxsize: int = 4096) -> None:
        super().__init__()
        self.maxsize = maxsize

    def __setitem__(self, key, value) -> None:
        if len(self) >= self.maxsize and key not in self:
            del self[next(iter(self))]
        super().__setitem__(key, value)


class CachedLauncher:
    """Launches a Triton JIT kernel, binding its arguments through Triton once per key.

    ``kernel[grid](...)`` binds and specializes every argument, builds a cache key and
    looks the compiled variant up on each call: about 20 µs of host time for a kernel of
    45 arguments (H200, Triton 3.6; ``profiling/bench_host.py``), more than the GPU time of
    a decode-step kernel. Here the first launch of a ``key`` goes through Triton as usual
    and keeps the compiled variant it returns; later launches of that key call the variant's
    launcher directly, as ``JITFunction.run`` itself does once it has found the variant
    (launch metadata and launch hooks included). The caller's ``key`` must therefore
    determine everything Triton specializes a variant on: the constexpr values and options,
    the dtype and the 16-byte alignment of every tensor argument, and the value of every
    integer argument that is not in the kernel's ``do_not_specialize`` (strides, sizes).
    Launches on CPU tensors (the interpreter) always take the ordinary path, and launches
    traced under :func:`traced_launches` become ``wrap_triton(kernel)[grid](...)`` calls.

    Args:
        kernel: a ``triton.jit`` function whose runtime arguments come first, positionally,
            and whose constexpr parameters come last.
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.variants: BoundedCache = BoundedCache()
        self.direct = True  # off if this Triton's compiled kernels launch differently

    def __call__(self, key: Hashable, grid: tuple[int, int, int], args: tuple, device_index: int,
                 specialize: Callable[[], tuple[dict, dict]]) -> None:
        """Launch ``kernel[grid](*args, **constexprs, **options)`` on the current stream of
        CUDA device ``device_index`` (-1: a CPU tensor, the interpreter), where
        ``specialize()`` gives ``(constexprs, options)``; it is called only when ``key`` has
        no variant yet."""
        if tracing_launches():
            constexprs, options = specialize()
            wrap_triton(self.kernel)[grid](*args, **constexprs, **options)
            return
        variant = self.variants.get(key) if self.direct else None
        if variant is None:
            constexprs, options = specialize()
            compiled = self.kernel[grid](*args, **constexprs, **options)
            if device_index >= 0 and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                tail = tuple(constexprs[name] for name in self.kernel.arg_names[len(args):])
                self.variants[key] = (compiled, tail)
            return
        compiled, tail = variant
        stream = _current_raw_stream(device_index)
        try:
            compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata(grid, stream, *args, *tail), knobs.runtime.launch_enter_hook,
                         knobs.runtime.launch_exit_hook, *args, *tail)
        except TypeError:  # the launcher refused the arguments before launching: the ordinary path
            self.direct = False
            constexprs, options = specialize()
            self.kernel[grid](*args, **constexprs, **options)


_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
