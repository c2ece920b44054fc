"""``reshape_and_cache``: scatter new keys/values into the paged KV cache.

Semantics of vLLM's ``reshape_and_cache_flash``: token ``t`` goes to block
``slot_mapping[t] // block_size``, offset ``slot_mapping[t] % block_size``; a slot of ``-1``
(``PAD_SLOT_ID``, padded rows of a captured batch) is skipped. Grid ``(T, chunks of
Hkv * D)``: shapes only. A token's ``[Hkv, D]`` is copied as one flat masked range, so any
head size ``D`` works unpadded.
"""

import torch
import triton
import triton.language as tl

from .launch_utils import CachedLauncher, alignments, device_guard, next_power_of_2

MAX_CHUNK = 2048


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Copy one chunk of ``key[t]``/``value[t]`` (``[Hkv, D]``, flattened) to slot
    ``slot_mapping[t]`` of ``key_cache``/``value_cache`` (``[num_blocks, BLOCK_SIZE, Hkv, D]``)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    elems = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    head = elems // HEAD_SIZE
    dim = elems % HEAD_SIZE
    mask = elems < NUM_KV_HEADS * HEAD_SIZE
    key = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim * stride_kd, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim * stride_vd, mask=mask)
    tl.store(key_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch
             + dim * stride_kcd, key, mask=mask)
    tl.store(value_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch
             + dim * stride_vcd, value, mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``key_cache``/``value_cache``
    ``[num_blocks, block_size, Hkv, D]`` (same dtype) at ``slot_mapping`` ``[T]`` int64;
    ``-1`` slots are skipped. Any strides (a strided ``slot_mapping`` is copied); CUDA
    tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()  # read as a dense vector
    chunk = min(next_power_of_2(num_kv_heads * head_size), MAX_CHUNK)
    grid = (num_tokens, triton.cdiv(num_kv_heads * head_size, chunk), 1)
    tensors = (key, value, key_cache, value_cache, slot_mapping)
    strides = (*key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride())
    device_index = key.get_device()
    launch_key = (key.shape[1:], key_cache.shape[1], strides, key.dtype, key_cache.dtype, device_index,
                  alignments(tensors))
    with device_guard(key):
        _LAUNCH(launch_key, grid, (*tensors, *strides), device_index, lambda: (dict(
            BLOCK_SIZE=key_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, CHUNK=chunk), {}))


_LAUNCH = CachedLauncher(reshape_and_cache_kernel)
