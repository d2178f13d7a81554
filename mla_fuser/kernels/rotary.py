"""Rotary position embedding of an MLA query's rope part and the key's rope latent in one launch.

Why a kernel: the modeling code rotates with a row of small torch ops (casts to fp32, views as complex, two complex
products, casts back; or slices, four products, two sums and a cat per tensor): 6-10 launches per layer in a
decode step whose every launch costs ~1.5-3 us on a GPU, for 64 values per head.  Here one launch rotates both.

The math, and where it rounds, is one of three *recipes*, each the exact op sequence of a rotary written in
Transformers (``rotary_ref`` is the torch twin, those very ops).  ``R`` is the rope width, ``P = R // 2`` the
number of rotated pairs, ``(a, b)`` a pair, ``c, s`` its cosine and sine; ``r(.)`` rounds to the input dtype:

* ``"pairs_fp32"`` (DeepSeek-V2: the pair ``(x[2i], x[2i+1])`` as a complex number times ``freqs_cis``)::

      a, b = x[2i].float(), x[2i+1].float()
      out[2i], out[2i+1] = r(a*c - b*s), r(a*s + b*c)        # fp32, rounded once

  ``c, s`` are fp32 (the real and imaginary parts of the complex table ``[.., T, P]``);
* ``"pairs_to_halves"`` (DeepSeek-V3's ``rope_interleave``: pairs in, halves out, in the input dtype)::

      a, b = x[2i], x[2i+1]
      out[i], out[P+i] = r(r(a*c) - r(b*s)), r(r(b*c) + r(a*s))

  ``c, s`` are the first halves of ``cos``/``sin`` ``[.., T, R]`` (input dtype);
* ``"halves"`` (``rotate_half``: Llama-style, MiniCPM3, DeepSeek-V3 without interleave)::

      a, b = x[i], x[P+i]
      out[i]   = r(r(a*cos[i])   + r(-b*sin[i]))
      out[P+i] = r(r(b*cos[P+i]) + r(a*sin[P+i]))

With 16-bit inputs the recipes' per-op roundings leave nothing to reassociate, so the kernel equals the twin
bitwise wherever each product is exact in fp32 (it is: a 16-bit times a 16-bit value); the fp32 sums of
``pairs_fp32`` and every recipe on fp32 inputs may be contracted into fused multiply-adds by the compiler, a
difference of at most one unit in the last place of the output.

Layout: ``q [B, Hq, T, R]`` and ``k [B, Hk, T, R]`` (any strides, the last dim unit-stride or not); tables ``[Bt, T,
W]`` with ``Bt`` 1 or ``B`` (any strides: a complex table's real and imaginary parts are strided views).  The outputs
are new contiguous tensors of the inputs' shapes and dtype, as the modeling code's are; with ``q_nope`` the query's
output is ``[B, Hq, T, N + R]``, the query joined (the launch that saves the modeling code's ``torch.cat``).
"""

from __future__ import annotations

import torch

from .dispatch import LazyJit, cdiv, next_pow2, tl, use_triton

__all__ = ["RECIPES", "rotary", "rotary_problem", "rotary_ref", "rotary_triton", "table_width"]

RECIPES = ("pairs_fp32", "pairs_to_halves", "halves")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROWS_PER_PROGRAM = 16


def table_width(recipe: str, rope: int) -> int:
    """Entries per token of the recipe's cos/sin tables: one per pair, or (``halves``) one per value."""
    return rope if recipe == "halves" else rope // 2


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, recipe: str) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [Bt, 1, T, W]: broadcast over heads
    if recipe == "pairs_fp32":
        a, b = x[..., 0::2].float(), x[..., 1::2].float()
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)
    if recipe == "pairs_to_halves":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, recipe: str):
    """Torch twin: the recipe's ops as the modeling code writes them (module docstring); ``(q_out, k_out)``."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown rotary recipe {recipe!r}; one of {RECIPES}")
    return _rotate_ref(q, cos, sin, recipe), _rotate_ref(k, cos, sin, recipe)


@LazyJit
def _rotary_kernel(Q, K, QO, KO, C, S, N, n_q, n_rows, Hq, Hk, T,
                   sqb, sqh, sqt, sqr, skb, skh, skt, skr, scb, sct, scw, ssb, sst, ssw, snb, snh, snt, snr,
                   RECIPE: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr, ROWS: tl.constexpr,
                   NOPE: tl.constexpr, BLOCK_NOPE: tl.constexpr):
    # ROWS rows per program; a row is one (b, h, t) of q (rows [0, n_q)) or of k (rows [n_q, n_rows)).  With NOPE > 0
    # a q row of the output is NOPE + 2P wide: the row of N (the query's other part) copied, then the rotated values.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    is_k = rows >= n_q
    local = tl.where(is_k, rows - n_q, rows)  # int64: offsets below may pass 2**31 on large batches
    heads = tl.where(is_k, Hk, Hq)
    t = local % T
    h = (local // T) % heads
    b = local // (T * heads)
    src = tl.where(is_k, b * skb + h * skh + t * skt, b * sqb + h * sqh + t * sqt)
    step = tl.where(is_k, skr, sqr)
    # outputs are contiguous: k rows [.., R], q rows [.., NOPE + R] with the rotated values after the copied ones
    dst = tl.where(is_k, local * (2 * P), local * (NOPE + 2 * P) + NOPE)
    i = tl.arange(0, BLOCK_P)
    mask = live[:, None] & (i < P)[None, :]
    if RECIPE == 2:  # halves: a = x[i], b = x[P + i]
        ia, ib = i, i + P
    else:  # pairs: a = x[2i], b = x[2i + 1]
        ia, ib = 2 * i, 2 * i + 1
    q_rows = ~is_k[:, None]
    k_rows = is_k[:, None]
    pa = src[:, None] + ia[None, :] * step[:, None]
    pb = src[:, None] + ib[None, :] * step[:, None]
    a = tl.where(k_rows, tl.load(K + pa, mask=mask & k_rows, other=0.0).to(tl.float32),
                 tl.load(Q + pa, mask=mask & q_rows, other=0.0).to(tl.float32))
    bv = tl.where(k_rows, tl.load(K + pb, mask=mask & k_rows, other=0.0).to(tl.float32),
                  tl.load(Q + pb, mask=mask & q_rows, other=0.0).to(tl.float32))
    tb = b * scb + t * sct  # scb is 0 for a table shared by the batch
    ts = b * ssb + t * sst
    ca = tl.load(C + tb[:, None] + i[None, :] * scw, mask=mask, other=0.0).to(tl.float32)
    sa = tl.load(S + ts[:, None] + i[None, :] * ssw, mask=mask, other=0.0).to(tl.float32)
    dt = QO.dtype.element_ty
    if RECIPE == 0:  # pairs_fp32: fp32 math, one rounding
        oa = a * ca - bv * sa
        ob = a * sa + bv * ca
        oa_at, ob_at = 2 * i, 2 * i + 1
    elif RECIPE == 1:  # pairs_to_halves: every op rounded to the input dtype
        oa = (a * ca).to(dt).to(tl.float32) - (bv * sa).to(dt).to(tl.float32)
        ob = (bv * ca).to(dt).to(tl.float32) + (a * sa).to(dt).to(tl.float32)
        oa_at, ob_at = i, i + P
    else:  # halves: the second half of the tables for the second half of the row
        cb = tl.load(C + tb[:, None] + (i + P)[None, :] * scw, mask=mask, other=0.0).to(tl.float32)
        sb = tl.load(S + ts[:, None] + (i + P)[None, :] * ssw, mask=mask, other=0.0).to(tl.float32)
        oa = (a * ca).to(dt).to(tl.float32) + (-(bv * sa)).to(dt).to(tl.float32)
        ob = (bv * cb).to(dt).to(tl.float32) + (a * sb).to(dt).to(tl.float32)
        oa_at, ob_at = i, i + P
    oa = oa.to(dt)
    ob = ob.to(dt)
    qa = dst[:, None] + oa_at[None, :]
    qb = dst[:, None] + ob_at[None, :]
    tl.store(QO + qa, oa, mask=mask & q_rows)
    tl.store(QO + qb, ob, mask=mask & q_rows)
    tl.store(KO + qa, oa, mask=mask & k_rows)
    tl.store(KO + qb, ob, mask=mask & k_rows)
    if NOPE > 0:
        j = tl.arange(0, BLOCK_NOPE)
        copy = live[:, None] & q_rows & (j < NOPE)[None, :]
        at = (b * snb + h * snh + t * snt)[:, None] + j[None, :] * snr
        tl.store(QO + (local * (NOPE + 2 * P))[:, None] + j[None, :], tl.load(N + at, mask=copy, other=0.0),
                 mask=copy)


def rotary_problem(q, k, cos, sin, recipe, q_nope=None) -> str | None:
    """Why :func:`rotary` cannot take these operands, or None (``rotary_call`` asks before a call, the launchers
    raise it)."""
    if q_nope is not None and (q_nope.dim() != 4 or q_nope.shape[:3] != q.shape[:3] or q_nope.dtype != q.dtype
                               or q_nope.device != q.device):
        return f"q_nope {tuple(q_nope.shape)} {q_nope.dtype} does not go with q {tuple(q.shape)} {q.dtype}"
    if recipe not in RECIPES:
        return f"unknown rotary recipe {recipe!r}; one of {RECIPES}"
    if q.dim() != 4 or k.dim() != 4:
        return f"q and k must be [B, H, T, R]; got {tuple(q.shape)} and {tuple(k.shape)}"
    B, _, T, R = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != R or R % 2 or q.dtype != k.dtype:
        return f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} do not pair up"
    want = table_width(recipe, R)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, B) or t.shape[1] != T or t.shape[2] != want:
            return f"{name} must be [1 or {B}, {T}, {want}] for {recipe}; got {tuple(t.shape)}"
    return None


def _check(q, k, cos, sin, recipe, q_nope=None):
    problem = rotary_problem(q, k, cos, sin, recipe, q_nope)
    if problem is not None:
        raise ValueError(problem)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, recipe: str,
                  q_nope: torch.Tensor | None = None):
    """Triton path of :func:`rotary` (no dispatch)."""
    _check(q, k, cos, sin, recipe, q_nope)
    B, Hq, T, R = q.shape
    Hk = k.shape[1]
    nope = 0 if q_nope is None else q_nope.shape[-1]
    q_out = torch.empty((B, Hq, T, nope + R), dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    n_q, n_k = B * Hq * T, B * Hk * T
    if n_q + n_k == 0:
        return q_out, k_out
    cb = 0 if cos.shape[0] == 1 else cos.stride(0)
    sb = 0 if sin.shape[0] == 1 else sin.stride(0)
    grid = (cdiv(n_q + n_k, ROWS_PER_PROGRAM),)
    _rotary_kernel[grid](
        q, k, q_out, k_out, cos, sin, q if q_nope is None else q_nope, n_q, n_q + n_k, Hq, Hk, T,
        *q.stride(), *k.stride(), cb, cos.stride(1), cos.stride(2), sb, sin.stride(1), sin.stride(2),
        *(q.stride() if q_nope is None else q_nope.stride()),
        RECIPE=RECIPES.index(recipe), P=R // 2, BLOCK_P=next_pow2(R // 2), ROWS=ROWS_PER_PROGRAM,
        NOPE=nope, BLOCK_NOPE=next_pow2(max(nope, 1)), num_warps=1,
    )
    return q_out, k_out


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, recipe: str,
           q_nope: torch.Tensor | None = None):
    """``(q_out, k_out)``: both rotated by ``recipe`` (module docstring); with ``q_nope`` (``[B, Hq, T, N]``, any
    strides) ``q_out`` is ``torch.cat((q_nope, rotated q), -1)``, made in the same launch (the query an MLA forward
    joins right after its rotary: ``rotary_call.RotaryCall.join``).  The Triton kernel where
    ``dispatch.use_triton`` says so and the dtypes are the kernel's, else :func:`rotary_ref`; the kernel has no
    backward, so the reference runs while autograd records."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                        or (q_nope is not None and q_nope.requires_grad))
    if use_triton(q, k) and q.dtype in KERNEL_DTYPES and q.dtype == k.dtype and not grad:
        return rotary_triton(q, k, cos, sin, recipe, q_nope)
    _check(q, k, cos, sin, recipe, q_nope)
    q_out, k_out = rotary_ref(q, k, cos, sin, recipe)
    return (q_out if q_nope is None else torch.cat((q_nope, q_out), dim=-1)), k_out
