"""Small host-side helpers shared by the kernel launchers."""

import contextlib
import functools

import torch


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()


def device_guard(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``tensor``'s GPU current while a kernel launches (Triton launches on the
    current device); nothing for CPU tensors (the Triton interpreter)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the CPU (the Triton interpreter
    runs one program at a time)."""
    if device.type != "cuda":
        return 1
    return _cuda_multiprocessors(torch.cuda.current_device() if device.index is None else device.index)
