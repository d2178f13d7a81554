"""The FP8 latent row: its format, the torch quantise / dequantise that define it, and the Triton writes.

An FP8 paged cache (``PagedLatentCache(..., dtype=torch.float8_e4m3fn)``) keeps, per token and layer, one packed row
of ``packed_width(D)`` bytes in a ``float8_e4m3fn`` page pool ``[num_pages, page_size, W]``::

    [ kv_c: v_dim e4m3 | k_pe: rope e4m3 | (pad to 4 B) | scale_c fp32 | scale_pe fp32 | pad to 16 B ]

with ``kv_c = e4m3(kv_c) * scale_c`` and ``k_pe = e4m3(k_pe) * scale_pe``; each scale is its part's max |x| / 448
(e4m3's largest finite value), so the largest entry of every row maps onto 448 and nothing saturates.  At DeepSeek's
shape (512 + 64) a row is 592 bytes against 1152 in bf16 (0.51x).

Why per token: a token's row is written once, when the token arrives, and never rewritten.  A per-tensor (per-layer)
scale would have to be fixed before the values it covers exist: a calibrated scale saturates the first token whose
latent exceeds the calibration (and the cache grows for as long as generation runs, across prompts the calibration
never saw), while a running max would need every earlier row requantised when it grows, an O(T) rewrite per step
that a captured decode step (fixed work) cannot do.  A per-token scale costs 8 bytes per 576 entries (1.4 %) and
gives every row e4m3's full relative precision (2**-4 half-ulp) whatever its magnitude.  Two scales rather than one:
``kv_c`` comes out of an RMSNorm while ``k_pe`` is a rotated projection with its own range; one shared scale would let
the larger part set the grid of the smaller.  The second scale is free: the 16-byte row alignment (wide loads in the
decode kernel) pads the row past both anyway.

Everything that moves whole rows (beam reorders, padding moves, sequence copies) moves the scales with them, so the
cache's page bookkeeping needs no change; its copies go through ``raw`` (a uint8 view: CPU ``index_copy_`` has no
float8 kernel).  The decode kernel reading these rows is :mod:`mla_fuser.kernels.mla_decode_fp8`.
"""

from __future__ import annotations

import torch

from .dispatch import MAX_COMBINE, LazyJit, next_pow2, tl, triton_interpreting

__all__ = ["FP8_DTYPE", "FP8_MAX", "dequantise_rows", "is_fp8", "packed_width", "paged_write_fp8_triton",
           "quantise_rows", "raw", "scale_column"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
_TINY = 1e-12  # the scale of an all-zero part (its entries are 0 either way)


def is_fp8(x) -> bool:
    """Whether ``x`` (a tensor or a dtype) is an FP8 latent pool's dtype."""
    return (x if isinstance(x, torch.dtype) else x.dtype) == FP8_DTYPE


def scale_column(width: int) -> int:
    """Byte offset of ``scale_c`` in a packed row of a ``width``-wide latent (``scale_pe`` follows it)."""
    return -(-width // 4) * 4


def packed_width(width: int) -> int:
    """Bytes of the packed row of a ``width``-wide latent (``kv_lora_rank + rope``): values, two fp32 scales,
    padded to 16 bytes."""
    return -(-(scale_column(width) + 8) // 16) * 16


def raw(pages: torch.Tensor) -> torch.Tensor:
    """``pages`` as bytes for copies (an FP8 pool), or ``pages`` itself (any other pool)."""
    return pages.view(torch.uint8) if pages.dtype == FP8_DTYPE else pages


def _scale(x32: torch.Tensor) -> torch.Tensor:
    return (x32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_TINY)


def quantise_rows(kv_c: torch.Tensor, k_pe: torch.Tensor | None) -> torch.Tensor:
    """``kv_c [..., v]`` and ``k_pe [..., rope]`` (or None) → packed rows ``[..., packed_width(v + rope)]`` float8
    (the reference of every FP8 write: both parts read in fp32, one max-abs scale each)."""
    c = kv_c.float()
    pe = c.new_zeros((*c.shape[:-1], 0)) if k_pe is None else k_pe.float()
    width = c.shape[-1] + pe.shape[-1]
    sc, spe = _scale(c), (_scale(pe) if pe.shape[-1] else torch.ones_like(c[..., :1]))
    values = torch.cat([c / sc, pe / spe], dim=-1).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    out = torch.zeros((*c.shape[:-1], packed_width(width)), dtype=torch.uint8, device=c.device)
    out[..., :width] = values.view(torch.uint8)
    col = scale_column(width)
    out[..., col:col + 8] = torch.cat([sc, spe], dim=-1).contiguous().view(torch.uint8)
    return out.view(FP8_DTYPE)


def dequantise_rows(rows: torch.Tensor, v_dim: int, width: int, dtype=torch.float32) -> torch.Tensor:
    """Packed rows ``[..., W]`` → ``[..., width]`` in ``dtype`` (values times their part's scale, in fp32)."""
    col = scale_column(width)
    scales = rows.view(torch.uint8)[..., col:col + 8].contiguous().view(torch.float32)  # [..., 2]
    values = rows[..., :width].to(torch.float32)
    out = torch.cat([values[..., :v_dim] * scales[..., :1], values[..., v_dim:] * scales[..., 1:]], dim=-1)
    return out if out.dtype == dtype else out.to(dtype)


# ----------------------------------------------------------------------------------------------------------------------
# Triton: one program per token quantises its row and stores values and scales (paged_write / paged_append)


@LazyJit
def _fp8_row_write_kernel(
    KV, KVS, SLOTS, TABLE, LENS, KV_C, K_PE,
    NEW, V_DIM, ROPE_DIM, SCALE_COL,
    stride_kvp, stride_kvt, stride_sp, stride_st, stride_tb, stride_cb, stride_cs, stride_pb, stride_ps,
    PAGE_SIZE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, HAS_ROPE: tl.constexpr,
    FROM_TABLE: tl.constexpr, ROUND_FIRST: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
):
    """``FROM_TABLE``: token ``t`` of sequence ``b`` (program ``b * NEW + t``) lands at position ``LENS[b] + t`` of
    the block table's row ``b`` (paged_append); else at ``SLOTS[program]``, skipped when negative (paged_write).
    ``ROUND_FIRST`` (the interpreter only): round to the e4m3 grid in fp32 before converting, as
    ``fp8.triton_kernels.act_quant_kernel`` does (the interpreter's conversion drops the carry across a power of
    two)."""
    pid = tl.program_id(0)
    if FROM_TABLE:
        b = pid // NEW
        t = pid % NEW
        pos = tl.load(LENS + b).to(tl.int64) + t
        page = tl.load(TABLE + b.to(tl.int64) * stride_tb + pos // PAGE_SIZE).to(tl.int64)
        off = pos % PAGE_SIZE
        src_c = KV_C + b.to(tl.int64) * stride_cb + t * stride_cs
        src_pe = K_PE + b.to(tl.int64) * stride_pb + t * stride_ps
        ok = pos >= 0
    else:
        slot = tl.load(SLOTS + pid).to(tl.int64)
        ok = slot >= 0
        safe = tl.where(ok, slot, 0)
        page = safe // PAGE_SIZE
        off = safe % PAGE_SIZE
        src_c = KV_C + pid.to(tl.int64) * stride_cs
        src_pe = K_PE + pid.to(tl.int64) * stride_ps
    dst = KV + page * stride_kvp + off * stride_kvt
    dst_s = KVS + page * stride_sp + off * stride_st + SCALE_COL
    offs_v = tl.arange(0, BLOCK_V)
    mv = (offs_v < V_DIM) & ((offs_v * 0 + ok.to(tl.int32)) > 0)  # (vector masks: see paged_cache_ops)
    c = tl.load(src_c + offs_v, mask=mv, other=0.0).to(tl.float32)
    sc = tl.maximum(tl.reduce(tl.abs(c), 0, MAX_COMBINE) / FP8_MAX, TINY)
    c = tl.minimum(tl.maximum(c / sc, -FP8_MAX), FP8_MAX)
    if ROUND_FIRST:  # nearest-even on the e4m3 grid in fp32 (spacing 2**(max(exponent, -6) - 3))
        e = ((c.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        magic = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True) * 12582912.0
        c = (c + magic) - magic
    tl.store(dst + offs_v, c.to(KV.dtype.element_ty), mask=mv)
    offs_s = tl.arange(0, 2)
    if HAS_ROPE:
        offs_r = tl.arange(0, BLOCK_R)
        mr = (offs_r < ROPE_DIM) & ((offs_r * 0 + ok.to(tl.int32)) > 0)
        pe = tl.load(src_pe + offs_r, mask=mr, other=0.0).to(tl.float32)
        spe = tl.maximum(tl.reduce(tl.abs(pe), 0, MAX_COMBINE) / FP8_MAX, TINY)
        pe = tl.minimum(tl.maximum(pe / spe, -FP8_MAX), FP8_MAX)
        if ROUND_FIRST:  # nearest-even on the e4m3 grid in fp32 (spacing 2**(max(exponent, -6) - 3))
            e = ((pe.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            magic = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True) * 12582912.0
            pe = (pe + magic) - magic
        tl.store(dst + V_DIM + offs_r, pe.to(KV.dtype.element_ty), mask=mr)
    else:
        spe = sc * 0.0 + 1.0
    scales = tl.where(offs_s == 0, sc, spe)
    tl.store(dst_s + offs_s, scales, mask=(offs_s * 0 + ok.to(tl.int32)) > 0)


def _launch(kv_pages, slots, table, lens, kv_c, k_pe, new, from_table):
    v_dim, rope = kv_c.shape[-1], k_pe.shape[-1]
    if packed_width(v_dim + rope) != kv_pages.shape[-1]:
        raise ValueError(f"kv_c ({v_dim}) + k_pe ({rope}) columns pack into {packed_width(v_dim + rope)} bytes, "
                         f"the FP8 cache rows are {kv_pages.shape[-1]}")
    if kv_pages.stride(-1) != 1 or kv_pages.stride(0) % 4 or kv_pages.stride(1) % 4:
        raise ValueError("FP8 cache rows must be unit-stride and 4-byte aligned (the write is in place)")
    tokens = kv_c.shape[0] * (new if from_table else 1)
    if tokens == 0:
        return
    kv_c = kv_c if kv_c.stride(-1) == 1 else kv_c.contiguous()
    k_pe = (k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()) if rope else kv_c
    scales = kv_pages.view(torch.float32)  # the same memory, fp32 elements (the scale columns)
    cstride = (kv_c.stride(0), kv_c.stride(1)) if from_table else (0, kv_c.stride(0))
    pstride = (k_pe.stride(0), k_pe.stride(1)) if from_table else (0, k_pe.stride(0))
    _fp8_row_write_kernel[(tokens,)](
        kv_pages, scales, slots, table, lens, kv_c, k_pe, new, v_dim, rope, scale_column(v_dim + rope) // 4,
        kv_pages.stride(0), kv_pages.stride(1), scales.stride(0), scales.stride(1), table.stride(0),
        *cstride, *pstride,
        PAGE_SIZE=kv_pages.shape[1], BLOCK_V=next_pow2(v_dim),
        BLOCK_R=next_pow2(max(rope, 1)), HAS_ROPE=rope > 0, FROM_TABLE=from_table,
        ROUND_FIRST=triton_interpreting(), FP8_MAX=FP8_MAX, TINY=_TINY,
        num_warps=4 if v_dim + rope >= 256 else 1,
    )  # fmt: skip


def paged_write_fp8_triton(kv_pages, slot_mapping, kv_c, k_pe) -> None:
    """``paged_cache_ops.paged_write`` into an FP8 pool: ``kv_c [N, v]``, ``k_pe [N, rope]``, slots ``[N]``."""
    if slot_mapping.shape[0] != kv_c.shape[0]:
        raise ValueError("slot_mapping must have one slot per token")
    _launch(kv_pages, slot_mapping, slot_mapping.view(1, -1), slot_mapping, kv_c, k_pe, 1, False)


def paged_append_fp8_triton(kv_pages, block_table, seq_lens, kv_c, k_pe) -> None:
    """``paged_cache_ops.paged_append`` into an FP8 pool: ``kv_c [B, S, v]``, ``k_pe [B, S, rope]``."""
    batch, new = kv_c.shape[:2]
    if block_table.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError("block_table must be [B, max_pages] and seq_lens [B] for kv_c [B, S, v]")
    if block_table.stride(-1) != 1:
        raise ValueError("block-table rows must be unit-stride")
    _launch(kv_pages, seq_lens, block_table, seq_lens, kv_c, k_pe, new, True)
