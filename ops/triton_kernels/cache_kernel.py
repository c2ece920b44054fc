"""``reshape_and_cache``: scatter new keys/values into the paged KV cache.

Semantics of vLLM's ``reshape_and_cache_flash``: token ``t`` goes to block
``slot_mapping[t] // block_size``, offset ``slot_mapping[t] % block_size``; a slot of ``-1``
(``PAD_SLOT_ID``, padded rows of a captured batch) is skipped. Grid ``(T, chunks of
Hkv * D)``: shapes only. A token's ``[Hkv, D]`` is copied as one flat masked range, so any
head size ``D`` works unpadded.

A float8_e4m3fn cache (vLLM's ``kv_cache_dtype="fp8"``) stores ``(x / scale)`` computed in
float32 (an IEEE-rounded division, ``div_rn``) and rounded to the nearest float8_e4m3fn
value, ties to even, saturating to +-448, NaN kept: ``torch``'s
``(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`` bit for bit. On a GPU the
float8 code is the hardware's conversion (``cvt.rn.satfinite.e4m3x2.f32``, sm89+: that
rounding and saturation, one instruction per two values; :func:`_encode`). Under Triton's
interpreter, whose float32 -> float8 rounding drops the carry of a rounded-up mantissa
(1.97 becomes 1.0), it is computed with integer arithmetic (:func:`_to_e4m3`), as it was
on the GPU too until the H200 measured the kernel at 0.53 of the copy bandwidth (T=65536,
2026-11-30): bound by instructions rather than bytes, about 40 SASS instructions a value
(Triton 3.6, sm90), 17 of them the integer encoding and 15 the division; with the
conversion, 26.
"""

import torch
import triton
import triton.language as tl

from .launch_utils import CachedLauncher, alignments, device_guard, next_power_of_2

MAX_CHUNK = 2048
FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _to_e4m3(x):
    """float32 -> float8_e4m3fn codes (int8): nearest value, ties to even, saturating to
    +-448, NaN kept (its sign too)."""
    x = tl.where(x > FP8_MAX, FP8_MAX, tl.where(x < -FP8_MAX, -FP8_MAX, x))  # NaN compares false
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Normal float8 (|x| >= 2^-6, biased float32 exponent >= 121): round the 23-bit mantissa to
    # 3 bits, ties to even (a carry moves into the exponent), and rebias the exponent 127 -> 7.
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal float8 (|x| < 2^-6): multiples of 2^-9. Adding 1.5 * 2^14 rounds |x| to one
    # (ties to even: float32 addition), and the multiple is the float8 code.
    tiny = tl.where(magnitude < (121 << 23), tl.abs(x), 0.0)
    subnormal = (((tiny + 24576.0) - 24576.0) * 512.0).to(tl.int32)
    code = tl.where(magnitude < (121 << 23), subnormal, normal)
    code = tl.where(magnitude > 0x7F800000, 0x7F, code) | sign
    return code.to(tl.int8)


@triton.jit
def _encode(x, HW_CVT: tl.constexpr):
    """float32 -> float8_e4m3fn codes (int8), as :func:`_to_e4m3`; ``HW_CVT``: by the GPU's
    conversion, which saturates as the clamp does and gives every NaN the code 0x7F (the
    sign bit is ORed back: it is already set for the other negative values)."""
    if HW_CVT:
        code = x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.int8, bitcast=True)
        return code | ((x.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.int8)
    return _to_e4m3(x)


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    CHUNK: tl.constexpr, FP8: tl.constexpr, K_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """Copy one chunk of ``key[t]``/``value[t]`` (``[Hkv, D]``, flattened) to slot
    ``slot_mapping[t]`` of ``key_cache``/``value_cache`` (``[num_blocks, BLOCK_SIZE, Hkv, D]``);
    ``FP8``: quantized with ``k_scale``/``v_scale`` (``K_SCALED``/``V_SCALED``, else 1), the
    codes by the GPU's conversion (``HW_CVT``) or by integer arithmetic. Every load is issued
    before the slot is known (a padded row only masks its stores), so a program waits for
    memory once."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if K_SCALED:
        k_scale = tl.load(k_scale_ptr)
    if V_SCALED:
        v_scale = tl.load(v_scale_ptr)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    elems = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    head = elems // HEAD_SIZE
    dim = elems % HEAD_SIZE
    mask = elems < NUM_KV_HEADS * HEAD_SIZE
    key = tl.load(key_ptr + token * stride_kt + head * stride_kh + dim * stride_kd, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + head * stride_vh + dim * stride_vd, mask=mask)
    if FP8:
        key = key.to(tl.float32)
        value = value.to(tl.float32)
        if K_SCALED:
            key = tl.math.div_rn(key, k_scale)
        if V_SCALED:
            value = tl.math.div_rn(value, v_scale)
        key = _encode(key, HW_CVT).to(tl.float8e4nv, bitcast=True)
        value = _encode(value, HW_CVT).to(tl.float8e4nv, bitcast=True)
    written = elems < tl.where(slot >= 0, NUM_KV_HEADS * HEAD_SIZE, 0)  # nothing for a padded row
    tl.store(key_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch
             + dim * stride_kcd, key, mask=written)
    tl.store(value_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch
             + dim * stride_vcd, value, mask=written)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``key_cache``/``value_cache``
    ``[num_blocks, block_size, Hkv, D]`` (same dtype, or float8_e4m3fn: quantized with the
    float32 ``k_scale``/``v_scale``, ``None`` = 1; ignored for other caches) at
    ``slot_mapping`` ``[T]`` int64; ``-1`` slots are skipped. Any strides (a strided
    ``slot_mapping`` is copied); CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if not fp8:
        k_scale = v_scale = None
    slot_mapping = slot_mapping.contiguous()  # read as a dense vector
    chunk = min(next_power_of_2(num_kv_heads * head_size), MAX_CHUNK)
    grid = (num_tokens, triton.cdiv(num_kv_heads * head_size, chunk), 1)
    tensors = (key, value, key_cache, value_cache, slot_mapping,
               key if k_scale is None else k_scale, key if v_scale is None else v_scale)
    strides = (*key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride())
    device_index = key.get_device()
    launch_key = (key.shape[1:], key_cache.shape[1], strides, key.dtype, key_cache.dtype, k_scale is None,
                  v_scale is None, device_index, alignments(tensors))
    with device_guard(key):
        _LAUNCH(launch_key, grid, (*tensors, *strides), device_index, lambda: (dict(
            BLOCK_SIZE=key_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, CHUNK=chunk,
            FP8=fp8, K_SCALED=k_scale is not None, V_SCALED=v_scale is not None, HW_CVT=key.is_cuda), {}))


_LAUNCH = CachedLauncher(reshape_and_cache_kernel)
