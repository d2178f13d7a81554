"""Writing new tokens' MLA latents into a paged cache, and reading a sequence back.

The cache is ``kv_pages[num_pages, page_size, D]`` with ``D = v_dim + rope_dim`` and each row
``[kv_c | k_pe]`` (see :mod:`mla_fuser.kernels.mla_decode`).  A token's destination is a flat *slot*
``page_id * page_size + offset``; a negative slot means "padding, do not write" (the convention of
paged serving engines, where padded batch rows carry slot -1).

Why a kernel: the write happens once per layer per step; in torch it is a ``cat`` of ``kv_c`` and
``k_pe`` (one temporary), a boolean mask and an indexed copy: several launches and a host sync for
the mask.  The Triton kernel reads both inputs and writes the row in one launch, one program per
token (each row is ~1 KB, so the launch is bandwidth bound with N programs in flight), and skips
negative slots with a store mask rather than a sync.  It is registered as the custom op
``mla_fuser::paged_write`` with ``mutates_args=("kv_pages",)`` so torch.compile keeps the in-place
write in order with the attention that reads it.
"""

from __future__ import annotations

import functools

import torch

from .dispatch import LazyJit, kernel_op, lazy_jit, next_pow2, tl, use_triton
from .latent_fp8 import is_fp8, paged_append_fp8_triton, paged_write_fp8_triton, quantise_rows
from .paged_cpu import paged_append_cpu

__all__ = ["paged_append", "paged_append_ref", "paged_append_triton", "paged_write", "paged_write_ref",
           "paged_write_triton", "paged_gather_ref"]


def paged_write_ref(kv_pages, slot_mapping, kv_c, k_pe) -> None:
    """Torch reference: ``kv_pages[slot // ps, slot % ps] = [kv_c | k_pe]`` for every slot >= 0.

    Indexes by (page, offset) rather than viewing the cache flat, so a cache whose page/token dims
    are not contiguous (e.g. a slice of a larger per-layer buffer) works too.  If two tokens share a
    slot, which one wins is unspecified (as in the kernel).
    """
    page_size = kv_pages.shape[1]
    if is_fp8(kv_pages):  # an FP8 pool: packed rows (values and per-token scales, see latent_fp8)
        row = quantise_rows(kv_c, k_pe)
    elif k_pe is None or k_pe.shape[-1] == 0:
        row = kv_c
    else:
        row = torch.cat([kv_c, k_pe.to(kv_c.dtype)], dim=-1)
    slot = slot_mapping.to(device=kv_pages.device, dtype=torch.long)
    valid = slot >= 0
    slot, row = slot[valid], row[valid]
    kv_pages[slot // page_size, slot % page_size] = row.to(kv_pages.dtype)


def paged_gather_ref(kv_pages, block_table, seq_lens) -> list[torch.Tensor]:
    """Each sequence's cache rows in order: a list of contiguous ``[L_b, D]`` tensors.

    Reads only the first ``ceil(L_b / page_size)`` entries of each block-table row.  Host-syncing
    (``tolist``); meant for tests and debugging.
    """
    page_size = kv_pages.shape[1]
    D = kv_pages.shape[2]
    out = []
    for b, L in enumerate(seq_lens.tolist()):
        n_pages = -(-int(L) // page_size)
        pages = block_table[b, :n_pages].to(device=kv_pages.device, dtype=torch.long)
        out.append(kv_pages[pages].reshape(n_pages * page_size, D)[: int(L)].contiguous())
    return out


@LazyJit
def _paged_write_kernel(
    KV,
    SLOTS,
    KV_C,
    K_PE,
    V_DIM,
    ROPE_DIM,
    stride_kvp,
    stride_kvt,
    stride_c,
    stride_pe,
    PAGE_SIZE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_ROPE: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(SLOTS + tok).to(tl.int64)
    safe = tl.where(slot >= 0, slot, 0)
    dst = KV + (safe // PAGE_SIZE) * stride_kvp + (safe % PAGE_SIZE) * stride_kvt
    # Padding tokens (slot < 0) are masked out of every load/store; the scalar condition is
    # broadcast to a vector first (the interpreter rejects scalar & vector bool masks).
    offs_v = tl.arange(0, BLOCK_V)
    mv = (offs_v < V_DIM) & ((offs_v * 0 + slot) >= 0)
    c = tl.load(KV_C + tok.to(tl.int64) * stride_c + offs_v, mask=mv)
    tl.store(dst + offs_v, c.to(KV.dtype.element_ty), mask=mv)
    if HAS_ROPE:
        offs_r = tl.arange(0, BLOCK_R)
        mr = (offs_r < ROPE_DIM) & ((offs_r * 0 + slot) >= 0)
        pe = tl.load(K_PE + tok.to(tl.int64) * stride_pe + offs_r, mask=mr)
        tl.store(dst + V_DIM + offs_r, pe.to(KV.dtype.element_ty), mask=mr)


def paged_write_triton(kv_pages, slot_mapping, kv_c, k_pe) -> None:
    """Triton path of :func:`paged_write` (no dispatch)."""
    N, v_dim = kv_c.shape
    rope = 0 if k_pe is None else k_pe.shape[-1]
    if v_dim + rope != kv_pages.shape[-1]:
        raise ValueError(f"kv_c ({v_dim}) + k_pe ({rope}) columns != cache row width {kv_pages.shape[-1]}")
    if slot_mapping.shape[0] != N:
        raise ValueError("slot_mapping must have one slot per token")
    if N == 0:
        return
    if kv_pages.stride(-1) != 1:
        raise ValueError("kv_pages rows must be unit-stride (the write is in place)")
    kv_c = kv_c if kv_c.stride(-1) == 1 else kv_c.contiguous()
    if rope > 0:
        k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    else:
        k_pe = kv_c  # unused pointer
    _paged_write_kernel[(N,)](
        kv_pages,
        slot_mapping,
        kv_c,
        k_pe,
        v_dim,
        rope,
        kv_pages.stride(0),
        kv_pages.stride(1),
        kv_c.stride(0),
        k_pe.stride(0),
        PAGE_SIZE=kv_pages.shape[1],
        BLOCK_V=next_pow2(v_dim),
        BLOCK_R=next_pow2(max(rope, 1)),
        HAS_ROPE=rope > 0,
        num_warps=4 if v_dim + rope >= 256 else 1,
    )


@kernel_op("paged_write", mutates_args=("kv_pages",))
def _paged_write_op(kv_pages: torch.Tensor, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
    if use_triton(kv_pages):
        (paged_write_fp8_triton if is_fp8(kv_pages) else paged_write_triton)(kv_pages, slot_mapping, kv_c, k_pe)
    else:
        paged_write_ref(kv_pages, slot_mapping, kv_c, k_pe)


@_paged_write_op.register_fake
def _paged_write_fake(kv_pages, slot_mapping, kv_c, k_pe) -> None:
    return None


def paged_write(kv_pages, slot_mapping, kv_c, k_pe) -> None:
    """Write tokens' latents into the paged cache, in place.

    Args:
        kv_pages: ``[num_pages, page_size, D]`` cache, modified in place.
        slot_mapping: int32/int64 ``[N]``; slot = page_id * page_size + offset; < 0 skips the token.
        kv_c: ``[N, v_dim]`` compressed latents; k_pe: ``[N, rope]`` (rope may be 0, or None).
    Inputs are cast to the cache dtype; a ``float8_e4m3fn`` cache is quantised per token (rows packed with
    their scales, :mod:`mla_fuser.kernels.latent_fp8`).  Backend: ``use_triton(kv_pages)``.  Under torch.compile the
    call goes through the ``mla_fuser::paged_write`` custom op (declared as mutating ``kv_pages``);
    in eager mode its implementation is called directly.
    """
    if k_pe is None:
        k_pe = kv_c.new_empty((kv_c.shape[0], 0))
    _paged_write_op(kv_pages, slot_mapping, kv_c, k_pe)


# ----------------------------------------------------------------------------------------------------------------------
# appending a step: slots computed in the kernel from the block table and the lengths


def paged_append_ref(kv_pages, block_table, seq_lens, kv_c, k_pe) -> None:
    """Torch reference of :func:`paged_append`: token ``t`` of sequence ``b`` goes to position
    ``seq_lens[b] + t``, i.e. page ``block_table[b, pos // page_size]``, row ``pos % page_size``."""
    batch, new = kv_c.shape[:2]
    page_size = kv_pages.shape[1]
    positions = seq_lens.view(-1, 1).long() + torch.arange(new, device=seq_lens.device).view(1, -1)
    page_ids = block_table.long().gather(1, positions // page_size)
    slots = (page_ids * page_size + positions % page_size).view(-1)
    paged_write_ref(kv_pages, slots, kv_c.reshape(batch * new, -1),
                    None if k_pe is None else k_pe.reshape(batch * new, -1))


@lazy_jit(do_not_specialize=("stride_tb",))
def _paged_append_kernel(
    KV,
    TABLE,
    LENS,
    KV_C,
    K_PE,
    NEW,
    V_DIM,
    ROPE_DIM,
    stride_kvp,
    stride_kvt,
    stride_tb,
    stride_cb,
    stride_cs,
    stride_pb,
    stride_ps,
    PAGE_SIZE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    ADVANCE: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // NEW
    t = pid % NEW
    length = tl.load(LENS + b)
    pos = length.to(tl.int64) + t
    if ADVANCE:  # (only with one new token: this program is then the only one that reads its length)
        tl.store(LENS + b, length + 1)
    page = tl.load(TABLE + b.to(tl.int64) * stride_tb + pos // PAGE_SIZE).to(tl.int64)
    dst = KV + page * stride_kvp + (pos % PAGE_SIZE) * stride_kvt
    offs_v = tl.arange(0, BLOCK_V)
    mv = offs_v < V_DIM
    c = tl.load(KV_C + b.to(tl.int64) * stride_cb + t * stride_cs + offs_v, mask=mv)
    tl.store(dst + offs_v, c.to(KV.dtype.element_ty), mask=mv)
    if HAS_ROPE:
        offs_r = tl.arange(0, BLOCK_R)
        mr = offs_r < ROPE_DIM
        pe = tl.load(K_PE + b.to(tl.int64) * stride_pb + t * stride_ps + offs_r, mask=mr)
        tl.store(dst + V_DIM + offs_r, pe.to(KV.dtype.element_ty), mask=mr)


def paged_append_triton(kv_pages, block_table, seq_lens, kv_c, k_pe, advance: bool = False) -> None:
    """Triton path of :func:`paged_append` (no dispatch)."""
    batch, new, v_dim = kv_c.shape
    rope = 0 if k_pe is None else k_pe.shape[-1]
    if v_dim + rope != kv_pages.shape[-1]:
        raise ValueError(f"kv_c ({v_dim}) + k_pe ({rope}) columns != cache row width {kv_pages.shape[-1]}")
    if block_table.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError("block_table must be [B, max_pages] and seq_lens [B] for kv_c [B, S, v]")
    if batch * new == 0:
        return
    in_kernel = advance and new == 1  # one program per sequence: it may write back the length it read
    if kv_pages.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("kv_pages rows and block-table rows must be unit-stride")
    kv_c = kv_c if kv_c.stride(-1) == 1 else kv_c.contiguous()
    if rope > 0:
        k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    else:
        k_pe = kv_c  # unused pointer
    kv_stride, c_stride, pe_stride = kv_pages.stride(), kv_c.stride(), k_pe.stride()  # (one call each)
    block_v, block_r, warps = _append_tiles(v_dim, rope)
    _paged_append_kernel[(batch * new,)](
        kv_pages, block_table, seq_lens, kv_c, k_pe, new, v_dim, rope,
        kv_stride[0], kv_stride[1], block_table.stride(0),
        c_stride[0], c_stride[1], pe_stride[0], pe_stride[1],
        PAGE_SIZE=kv_pages.shape[1], BLOCK_V=block_v,
        BLOCK_R=block_r, HAS_ROPE=rope > 0, ADVANCE=in_kernel,
        num_warps=warps,
    )  # fmt: skip
    if advance and not in_kernel:
        seq_lens += new


@functools.lru_cache(maxsize=256)  # (asked at every append: a few ints per row width)
def _append_tiles(v_dim: int, rope: int) -> tuple[int, int, int]:
    return next_pow2(v_dim), next_pow2(max(rope, 1)), 4 if v_dim + rope >= 256 else 1


@kernel_op("paged_append", mutates_args=("kv_pages", "seq_lens"))
def _paged_append_op(kv_pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     kv_c: torch.Tensor, k_pe: torch.Tensor, advance: bool) -> None:
    if use_triton(kv_pages):
        if not is_fp8(kv_pages):
            paged_append_triton(kv_pages, block_table, seq_lens, kv_c, k_pe, advance)  # (advances itself)
            return
        paged_append_fp8_triton(kv_pages, block_table, seq_lens, kv_c, k_pe)
    elif kv_pages.is_cpu:  # host reads are free there: slots as ints, a copy per page (paged_cpu)
        paged_append_cpu(kv_pages, block_table, seq_lens, kv_c, k_pe)
    else:
        paged_append_ref(kv_pages, block_table, seq_lens, kv_c, k_pe)
    if advance:
        seq_lens += kv_c.shape[1]


@_paged_append_op.register_fake
def _paged_append_fake(kv_pages, block_table, seq_lens, kv_c, k_pe, advance) -> None:
    return None


def paged_append(kv_pages, block_table, seq_lens, kv_c, k_pe, advance: bool = False) -> None:
    """Append a step's latents to every sequence of a paged cache, in place.

    Args:
        kv_pages: ``[num_pages, page_size, D]`` cache, modified in place.
        block_table: int32 ``[B, max_pages]``; seq_lens: int32 ``[B]``, the tokens each sequence holds *before*
            this step; with ``advance`` they are moved past the step in place (for a one-token step inside the
            Triton kernel: one launch fewer per layer of a decode step), else left as they are.
        kv_c: ``[B, S, v_dim]``; k_pe: ``[B, S, rope]`` (or None): token ``t`` of sequence ``b`` is written at
            position ``seq_lens[b] + t``.
    Why: the destination slots come from device memory inside the kernel, so a step costs one launch and no
    index arithmetic in torch (eight small launches per layer, a noticeable share of a captured decode step).
    The pages covering the new positions must already be in the block table.  A ``float8_e4m3fn`` cache is
    quantised per token (:mod:`mla_fuser.kernels.latent_fp8`).  Backend: ``use_triton(kv_pages)``;
    the torch backend runs ``paged_cpu.paged_append_cpu`` on CPU tensors, the reference elsewhere.
    """
    if k_pe is None:
        k_pe = kv_c.new_empty((*kv_c.shape[:2], 0))
    _paged_append_op(kv_pages, block_table, seq_lens, kv_c, k_pe, bool(advance))
