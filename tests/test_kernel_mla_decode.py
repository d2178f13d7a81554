"""Triton MLA decode over a paged latent cache (and paged writes) vs. their torch references.

The Triton kernels run under Triton's CPU interpreter on tiny shapes.  About the flags (checked on
triton 3.9): ``TRITON_INTERPRET`` is read when a function is *decorated* with ``triton.jit`` (it then
builds an ``InterpretedFunction`` instead of a compiled ``JITFunction``), and that includes the @jit
helpers of ``triton.language.standard`` (``tl.sum``, ``tl.max``, ``tl.cdiv``, ``tl.zeros``...),
which are decorated when triton is first *imported*.  Setting the flag with ``monkeypatch.setenv``
inside a test is nevertheless enough for these kernels, whatever was imported before, because
(1) they are decorated lazily, at first launch and once per mode (``dispatch.LazyJit``), and
(2) they use none of those helpers (``tl.reduce`` with the standard combine functions, which the
interpreter recognises, and ``tl.full`` instead).  ``test_interpreter_flag_set_after_import``
checks this: triton is imported by the kernel module at the top of this file, without the flag.
A kernel that does call ``tl.sum`` & co. needs ``TRITON_INTERPRET=1`` before triton's import.
``MLA_FUSER_BACKEND`` is read by ``dispatch.use_triton`` on every call.

Known interpreter limitation (triton 3.9): a bf16 x bf16 ``tl.dot`` returns garbage there, so
under the interpreter the kernel upcasts bf16 dot operands to fp32 after loading (``DOT_UPCAST``);
the bf16 tests below therefore check loads, masking, paging, splits and merging in bf16, but not
the bf16 tensor-core path itself (the GPU benchmark checks that against the reference).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
import torch

if importlib.util.find_spec("mla_fuser") is None:  # plain `pytest` from the repo without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mla_fuser.kernels import mla_decode as md  # noqa: E402
from mla_fuser.kernels import paged_cache_ops as pco  # noqa: E402
from mla_fuser.kernels.dispatch import triton_available  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed")


def _seed(s: int) -> torch.Generator:
    torch.manual_seed(s)
    return torch.Generator().manual_seed(s)


def make_case(lens, H, r, rope, page_size, dtype, seed, spare_pages=3, garbage=-1):
    """A paged cache with shuffled page ids and NaN everywhere no sequence owns.

    Pages of no sequence, and rows past a sequence's length in its last page, hold NaN: any read of
    them that reaches the math makes the output NaN, so masking bugs cannot hide.  Block-table
    entries past each sequence's pages hold ``garbage`` (e.g. -1 or a huge id) and one spare
    column exists beyond the longest sequence.
    """
    g = _seed(seed)
    D = r + rope
    n_pages = [math.ceil(L / page_size) for L in lens]
    total = sum(n_pages) + spare_pages
    perm = torch.randperm(total, generator=g)
    kv = torch.full((total, page_size, D), float("nan"))
    max_pages = max(n_pages + [0]) + 1
    bt = torch.full((len(lens), max_pages), garbage, dtype=torch.int32)
    used = 0
    for b, (L, n) in enumerate(zip(lens, n_pages)):
        pages = perm[used : used + n]
        used += n
        bt[b, :n] = pages.to(torch.int32)
        for i, p in enumerate(pages.tolist()):
            valid = min(page_size, L - i * page_size)
            kv[p, :valid] = torch.randn(valid, D, generator=g)
    q = torch.randn(len(lens), H, D, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return q.to(dtype), kv.to(dtype), bt, seq_lens


def naive(q, kv_pages, bt, seq_lens, scale, v_dim):
    """Token-by-token dense softmax attention in float64 (independent of the reference)."""
    B, H, D = q.shape
    ps = kv_pages.shape[1]
    out = torch.zeros(B, H, v_dim, dtype=torch.float64)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        rows = torch.stack([kv_pages[int(bt[b, t // ps]), t % ps] for t in range(L)]).double()
        for h in range(H):
            p = torch.softmax(scale * (rows @ q[b, h].double()), dim=0)
            out[b, h] = p @ rows[:, :v_dim]
    return out


def _ref32(q, kv, bt, lens, scale, r):
    """Reference in fp32 from the same (possibly bf16-rounded) inputs."""
    return md.mla_decode_ref(q.float(), kv.float(), bt, lens, scale, r)


def _check(out, ref, dtype):
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), "NaN/inf in output"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:  # p rounded to bf16 before p@V and the output rounded to bf16
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        assert (out.float() - ref).norm() <= 1e-2 * ref.norm() + 1e-6


# ------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize(
    "lens,H,r,rope,ps",
    [([0, 1, 16, 17, 40], 3, 32, 8, 16), ([5, 64, 65], 2, 16, 0, 64), ([3, 9], 4, 16, 8, 8)],
)
def test_ref_matches_naive(lens, H, r, rope, ps):
    q, kv, bt, sl = make_case(lens, H, r, rope, ps, torch.float32, seed=1)
    scale = 1.0 / math.sqrt(r + rope)
    out = md.mla_decode_ref(q, kv, bt, sl, scale, r)
    assert out.shape == (len(lens), H, r) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive(q, kv, bt, sl, scale, r), atol=1e-5, rtol=1e-5)
    assert (out[[i for i, L in enumerate(lens) if L == 0]] == 0).all()


def test_ref_bf16_returns_input_dtype():
    q, kv, bt, sl = make_case([7, 20], 2, 16, 8, 16, torch.bfloat16, seed=2)
    out = md.mla_decode_ref(q, kv, bt, sl, 0.2, 16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive(q.float(), kv.float(), bt, sl, 0.2, 16), atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------------------------- triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
def test_triton_ragged_page16(interp, dtype, num_splits):
    # lengths 0 and 1, exactly one page, page boundary + 1, several pages; H=3 < BLOCK_H.
    # num_splits=8 > pages of every sequence here: empty splits must weigh nothing.
    lens = [0, 1, 16, 17, 45]
    q, kv, bt, sl = make_case(lens, 3, 32, 8, 16, dtype, seed=10)
    out = md.mla_decode(q, kv, bt, sl, 0.17, 32, num_splits=num_splits)
    _check(out, _ref32(q, kv, bt, sl, 0.17, 32), dtype)
    assert (out[0] == 0).all()


def _with_starts_naive(q, kv, bt, lens, starts, scale, r):
    """``naive`` over each sequence's tokens from its start: the rows before it written as NaN first, so a
    kernel that reads them into the math shows it."""
    kv = kv.clone()
    ps = kv.shape[1]
    for b, s0 in enumerate(starts.tolist()):
        for t in range(min(s0, int(lens[b]))):
            kv[int(bt[b, t // ps]), t % ps] = float("nan")
    out = torch.zeros(q.shape[0], q.shape[1], r, dtype=torch.float64)
    for b, s0 in enumerate(starts.tolist()):
        L = int(lens[b])
        rows = torch.stack([kv[int(bt[b, t // ps]), t % ps] for t in range(s0, L)]).double()
        for h in range(q.shape[1]):
            p = torch.softmax(scale * (rows @ q[b, h].double()), dim=0)
            out[b, h] = p @ rows[:, :r]
    return out, kv


@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
@pytest.mark.parametrize("ps", [16, 64])
def test_triton_left_padding_starts(interp, num_splits, ps):
    """Starts inside the first tile, on a tile boundary, past whole tiles and splits (empty splits), and 0."""
    lens = [70, 45, 130, 9]
    starts = torch.tensor([5, 16, 97, 0], dtype=torch.int32)
    q, kv, bt, seq = make_case(lens, 3, 32, 8, ps, torch.float32, seed=31)
    want, kv = _with_starts_naive(q, kv, bt, seq, starts, 0.3, 32)
    ref = md.mla_decode_ref(q, kv, bt, seq, 0.3, 32, starts)
    torch.testing.assert_close(ref.double(), want, atol=1e-5, rtol=1e-5)
    out = md.mla_decode(q, kv, bt, seq, 0.3, 32, num_splits=num_splits, starts=starts)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_page64_rope0_h5(interp, dtype):
    # rope_dim = 0 (no rope dot), H=5, page_size 64 with tiles of BLOCK_N (64 in bf16, 32 in fp32).
    lens = [64, 1, 130, 0]
    q, kv, bt, sl = make_case(lens, 5, 16, 0, 64, dtype, seed=11, garbage=10**6)
    for ns in (None, 2, 5):
        out = md.mla_decode(q, kv, bt, sl, 0.3, 16, num_splits=ns)
        _check(out, _ref32(q, kv, bt, sl, 0.3, 16), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_swap_ab(interp, dtype):
    # Transposed-product formulation (S^T = KV Q^T, O^T = KV^T P^T), incl. rope 0 and 2 head tiles.
    for lens, H, r, rope, ps in [([0, 1, 17, 40], 3, 32, 8, 16), ([9, 70], 20, 16, 0, 32)]:
        q, kv, bt, sl = make_case(lens, H, r, rope, ps, dtype, seed=30 + H)
        ref = _ref32(q, kv, bt, sl, 0.2, r)
        cfg = md.MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=2, swap_ab=True)
        for ns in (1, 3):
            _check(md.mla_decode_triton(q, kv, bt, sl, 0.2, r, num_splits=ns, config=cfg), ref, dtype)


def test_triton_two_head_tiles_and_config(interp):
    # H=20 with BLOCK_H=16: a full and a partial head tile; explicit config incl. small BLOCK_N.
    lens = [33, 70]
    q, kv, bt, sl = make_case(lens, 20, 32, 16, 32, torch.float32, seed=12)
    ref = _ref32(q, kv, bt, sl, 0.2, 32)
    cfg = md.MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=2)
    for ns in (1, 4):
        _check(md.mla_decode_triton(q, kv, bt, sl, 0.2, 32, num_splits=ns, config=cfg), ref, torch.float32)
    # block_n larger than the page: tiles span pages (per-row page lookup).
    cfg = md.MLADecodeConfig(block_h=32, block_n=64)
    _check(md.mla_decode_triton(q, kv, bt, sl, 0.2, 32, num_splits=2, config=cfg), ref, torch.float32)


def test_triton_many_splits_chunked_merge(interp):
    # 150 splits > 128 merged per chunk: the merge runs two chunks, the second all empty.
    q, kv, bt, sl = make_case([40, 0], 2, 16, 8, 16, torch.float32, seed=17)
    cfg = md.MLADecodeConfig(block_h=16, block_n=16)
    out = md.mla_decode_triton(q, kv, bt, sl, 0.3, 16, num_splits=150, config=cfg)
    _check(out, _ref32(q, kv, bt, sl, 0.3, 16), torch.float32)


def test_triton_small_pages_per_row_lookup(interp):
    # page_size 8 < 16 (no 16-token tile fits in a page) and tiles of 64 over 16-token pages:
    # rows look their pages up one by one.
    lens = [3, 8, 25]
    q, kv, bt, sl = make_case(lens, 2, 16, 8, 8, torch.float32, seed=13)
    for ns in (1, 3):
        out = md.mla_decode(q, kv, bt, sl, 0.25, 16, num_splits=ns)
        _check(out, _ref32(q, kv, bt, sl, 0.25, 16), torch.float32)
    q, kv, bt, sl = make_case([70, 5], 3, 16, 8, 16, torch.float32, seed=18)
    for swap in (False, True):
        cfg = md.MLADecodeConfig(block_h=16, block_n=64, swap_ab=swap)
        _check(md.mla_decode_triton(q, kv, bt, sl, 0.25, 16, num_splits=2, config=cfg), _ref32(q, kv, bt, sl, 0.25, 16), torch.float32)


def test_triton_noncontiguous_q_and_all_empty(interp):
    q, kv, bt, sl = make_case([20, 9], 4, 16, 8, 16, torch.float32, seed=14)
    big = torch.randn(2, 8, 24)
    big[:, ::2] = q
    qv = big[:, ::2]  # head stride 2*D: exercises q strides
    assert not qv.is_contiguous()
    _check(md.mla_decode(qv, kv, bt, sl, 0.3, 16, num_splits=2), _ref32(q, kv, bt, sl, 0.3, 16), torch.float32)
    zero = torch.zeros_like(sl)
    for ns in (1, 3):
        out = md.mla_decode(q, kv, bt, zero, 0.3, 16, num_splits=ns)
        assert torch.equal(out, torch.zeros_like(out))


def test_interpreter_flag_set_after_import(monkeypatch):
    """The kernel modules are already imported (above) when the flags are set here."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("MLA_FUSER_BACKEND", "torch")
    q, kv, bt, sl = make_case([5], 2, 16, 8, 16, torch.float32, seed=15)
    ref = md.mla_decode(q, kv, bt, sl, 0.3, 16)  # torch backend
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    _check(md.mla_decode(q, kv, bt, sl, 0.3, 16), ref, torch.float32)


def test_custom_op_registered_and_fake(interp):
    q, kv, bt, sl = make_case([4, 17], 3, 16, 8, 16, torch.float32, seed=16)
    out = torch.ops.mla_fuser.mla_decode(q, kv, bt, sl, 0.3, 16, 2)
    _check(out, _ref32(q, kv, bt, sl, 0.3, 16), torch.float32)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fkv, fbt, fsl = (mode.from_tensor(t) for t in (q, kv, bt, sl))
        fo = torch.ops.mla_fuser.mla_decode(fq, fkv, fbt, fsl, 0.3, 16, None)
        assert fo.shape == (2, 3, 16) and fo.dtype == q.dtype
        fo = md.mla_decode(fq, fkv, fbt, fsl, 0.3, 16)  # subclass inputs go through the op
        assert fo.shape == (2, 3, 16)
        fk = mode.from_tensor(torch.zeros(4, 16, 24))
        pco.paged_write(fk, mode.from_tensor(torch.arange(3)), mode.from_tensor(torch.ones(3, 16)),
                        mode.from_tensor(torch.ones(3, 8)))


def test_choose_num_splits():
    sms = 132
    # Always >= 1, never more splits than pages, never below MIN_TILES_PER_SPLIT tiles per split.
    for B, ht, mp, ps, cta in [(1, 1, 512, 64, 2), (16, 1, 512, 64, 2), (64, 1, 128, 64, 2), (128, 2, 64, 64, 1),
                               (1, 1, 1, 64, 1), (3, 1, 2, 16, 1), (16, 2, 512, 64, 1)]:
        s = md.choose_num_splits(B, ht, mp, ps, 64, sms, cta)
        assert 1 <= s <= mp
        assert s == 1 or (mp * ps) // s >= 64 * md.MIN_TILES_PER_SPLIT
    assert md.choose_num_splits(64, 1, 128, 64, 64, sms, 2) == 4  # 256 programs in 264 slots
    assert md.choose_num_splits(64, 2, 128, 64, 64, sms, 1) == 1  # 128 programs: one per SM already
    assert md.choose_num_splits(1, 1, 512, 64, 64, sms, 1) == 128  # B=1: fill the SMs, four tiles per split
    # no split left empty at the longest sequence (S = 15 over 16 tiles would run 8 splits and 7 empty programs)
    assert md.choose_num_splits(16, 1, 16, 64, 64, sms, 2) == 16
    assert md.choose_num_splits(1, 1, 514, 64, 64, sms, 2) == 257
    for B, mp in [(1, 512), (1, 514), (2, 300), (16, 17), (16, 16), (5, 77), (3, 1000)]:
        s = md.choose_num_splits(B, 1, mp, 64, 64, sms, 2)
        tiles = mp  # (64-token pages, 64-token tiles)
        assert -(-tiles // -(-tiles // s)) == s, (B, mp, s)
    # short contexts at small batch: every tile in its own split (B=1 L=512 and B=4 L=1k measured fastest so)
    assert md.choose_num_splits(1, 1, 9, 64, 64, sms, 2) == 9
    assert md.choose_num_splits(4, 1, 16, 64, 64, sms, 2) == 16


# ------------------------------------------------------------------------------------- paged write


@pytest.mark.parametrize("rope", [8, 0])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_write_triton_vs_ref(interp, rope, slot_dtype, dtype):
    g = _seed(20)
    P, ps, r, N = 6, 16, 32, 12
    kv = torch.randn(P, ps, r + rope, generator=g).to(dtype)
    kv_ref = kv.clone()
    slots = torch.randperm(P * ps, generator=g)[:N].to(slot_dtype)
    slots[2] = -1
    slots[7] = -9
    kv_c = torch.randn(N, r, generator=g).to(dtype)
    k_pe = torch.randn(N, rope, generator=g).to(dtype)
    pco.paged_write(kv, slots, kv_c, k_pe)
    pco.paged_write_ref(kv_ref, slots, kv_c, k_pe)
    assert torch.equal(kv, kv_ref)
    # the written rows hold [kv_c | k_pe]; padding tokens were skipped
    s = slots.long()
    for i in range(N):
        if s[i] >= 0:
            assert torch.equal(kv[s[i] // ps, s[i] % ps], torch.cat([kv_c[i], k_pe[i]]))


@pytest.mark.parametrize("rope", [8, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new", [1, 5])
def test_paged_append_triton_vs_ref(interp, rope, dtype, new):
    """Slots from the block table and the lengths (ragged, crossing page boundaries), strided step inputs."""
    g = _seed(22)
    P, ps, r, B = 10, 4, 32, 3
    kv = torch.randn(P, ps, r + rope, generator=g).to(dtype)
    kv_ref = kv.clone()
    table = torch.randperm(P, generator=g)[: B * 3].view(B, 3).to(torch.int32)
    lens = torch.tensor([0, 3, 6], dtype=torch.int32)  # 6 + 5 = 11 <= 3 pages of 4
    rows = torch.randn(B, new, 1, r + rope + 3, generator=g).to(dtype)[:, :, 0]  # non-contiguous step
    kv_c, k_pe = rows[..., :r], rows[..., r:r + rope]
    pco.paged_append(kv, table, lens, kv_c, k_pe)
    pco.paged_append_ref(kv_ref, table, lens, kv_c, k_pe)
    assert torch.equal(kv, kv_ref)
    for b in range(B):  # the rows landed where the block table says
        for t in range(new):
            pos = int(lens[b]) + t
            assert torch.equal(kv[table[b, pos // ps], pos % ps], torch.cat([kv_c[b, t], k_pe[b, t]]))


@pytest.mark.parametrize("splits", [1, 3])
def test_rope_part_apart_equals_the_joined_query(interp, splits):
    """``q_rope`` given: ``q`` is the latent part (here a strided view, as the absorption's bmm leaves it) and the
    kernel reads both where they are; the result is the joined query's, bitwise; the torch path joins them."""
    r, rope, H = 16, 8, 3
    q, kv, bt, lens = make_case([5, 19, 0], H, r, rope, 4, torch.float32, seed=31)
    scale = (r + rope) ** -0.5
    joined = md.mla_decode(q, kv, bt, lens, scale, r, num_splits=splits)
    heads_first = q[..., :r].transpose(0, 1).contiguous().transpose(0, 1)  # [B, H, r] with strides (r, B*r, 1)
    apart = md.mla_decode(heads_first, kv, bt, lens, scale, r, num_splits=splits, q_rope=q[..., r:])
    assert torch.equal(apart, joined)
    with pytest.raises(ValueError, match="q_rope"):
        md.mla_decode(q, kv, bt, lens, scale, r, q_rope=q[..., r:])  # q must then be the latent part only


def test_rope_part_apart_on_the_torch_path():
    r, rope, H = 16, 8, 2
    q, kv, bt, lens = make_case([7, 2], H, r, rope, 4, torch.float32, seed=32)
    scale = (r + rope) ** -0.5
    assert torch.equal(md.mla_decode(q[..., :r], kv, bt, lens, scale, r, q_rope=q[..., r:]),
                       md.mla_decode(q, kv, bt, lens, scale, r))


@pytest.mark.parametrize("new", [1, 3])
def test_paged_append_advance_moves_the_lengths_past_the_step(interp, new):
    """``advance=True``: the same rows written, and the lengths moved by ``new`` (for one token inside the kernel,
    which then also reads each length once before writing it back)."""
    g = _seed(23)
    P, ps, r, rope, B = 10, 4, 16, 8, 3
    kv = torch.randn(P, ps, r + rope, generator=g)
    kv_ref = kv.clone()
    table = torch.randperm(P, generator=g)[: B * 3].view(B, 3).to(torch.int32)
    lens = torch.tensor([0, 3, 6], dtype=torch.int32)
    kv_c, k_pe = torch.randn(B, new, r, generator=g), torch.randn(B, new, rope, generator=g)
    pco.paged_append_ref(kv_ref, table, lens, kv_c, k_pe)
    moved = lens.clone()
    pco.paged_append(kv, table, moved, kv_c, k_pe, advance=True)
    assert torch.equal(kv, kv_ref) and torch.equal(moved, lens + new)
    unmoved = lens.clone()
    pco.paged_append(kv, table, unmoved, kv_c, k_pe)
    assert torch.equal(unmoved, lens)


def test_paged_write_then_decode_roundtrip(interp):
    """Fill a shuffled cache token by token with paged_write, gather it back, decode from it."""
    g = _seed(21)
    lens, ps, r, rope, H = [5, 19], 8, 16, 8, 2
    n_pages = [math.ceil(L / ps) for L in lens]
    perm = torch.randperm(sum(n_pages) + 2, generator=g)
    kv = torch.full((len(perm), ps, r + rope), float("nan"))
    bt = torch.full((2, max(n_pages)), -1, dtype=torch.int32)
    bt[0, : n_pages[0]] = perm[: n_pages[0]].int()
    bt[1, : n_pages[1]] = perm[n_pages[0] : sum(n_pages)].int()
    rows = [torch.randn(L, r + rope, generator=g) for L in lens]
    slots = torch.cat([bt[b, torch.arange(L) // ps].long() * ps + torch.arange(L) % ps for b, L in enumerate(lens)])
    allrows = torch.cat(rows)
    pco.paged_write(kv, slots, allrows[:, :r], allrows[:, r:])
    sl = torch.tensor(lens, dtype=torch.int32)
    back = pco.paged_gather_ref(kv, bt, sl)
    for b in range(2):
        assert torch.equal(back[b], rows[b])
    q = torch.randn(2, H, r + rope, generator=g)
    out = md.mla_decode(q, kv, bt, sl, 0.2, r, num_splits=2)
    dense = torch.stack(
        [torch.softmax(0.2 * q[b] @ rows[b].T, dim=-1) @ rows[b][:, :r] for b in range(2)]
    )
    torch.testing.assert_close(out, dense, atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------------- CPU paths (host-indexed)


def _consecutive_case(lens, H, r, rope, ps, dtype, seed):
    """``make_case`` with each sequence's pages consecutive ids (the pool view path), NaN elsewhere."""
    q, kv, bt, sl = make_case(lens, H, r, rope, ps, dtype, seed)
    kv2, bt2 = torch.full_like(kv, float("nan")), torch.full_like(bt, -1)
    start = 1  # page 0 stays NaN: a view that starts one page early shows
    for b, L in enumerate(lens):
        n = math.ceil(L / ps)
        kv2[start:start + n] = kv[bt[b, :n].long()]
        bt2[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    return q, kv2, bt2, sl


@pytest.mark.parametrize("layout", ["shuffled", "consecutive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_starts", [False, True])
def test_cpu_decode_matches_ref(layout, dtype, with_starts):
    """``mla_decode_cpu`` (what ``mla_decode`` runs for CPU tensors) against the reference: empty, partial, exact and
    multi-page sequences, pages gathered or viewed, left-padding starts (0, inside, past the length)."""
    from mla_fuser.kernels.paged_cpu import mla_decode_cpu

    lens = [0, 1, 16, 17, 45, 9]
    build = make_case if layout == "shuffled" else _consecutive_case
    q, kv, bt, sl = build(lens, 3, 32, 8, 16, dtype, seed=40)
    starts = torch.tensor([0, 0, 5, 16, 30, 12], dtype=torch.int32) if with_starts else None
    out = mla_decode_cpu(q, kv, bt, sl, 0.21, 32, starts)
    assert out.dtype == dtype and out.shape == (len(lens), 3, 32) and torch.isfinite(out).all()
    ref = md.mla_decode_ref(q, kv, bt, sl, 0.21, 32, starts)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    else:  # both compute in fp32 and round once
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    assert (out[0] == 0).all() and (not with_starts or (out[5] == 0).all())
    single = mla_decode_cpu(q[4:5], kv, bt[4:5], sl[4:5], 0.21, 32, None if starts is None else starts[4:5])
    torch.testing.assert_close(single, md.mla_decode_ref(q[4:5], kv, bt[4:5], sl[4:5], 0.21, 32,
                                                         None if starts is None else starts[4:5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("with_starts", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_cpu_absorbed_decode_matches_the_general_path(dtype, bias, with_starts, fp8):
    """``absorbed_decode_cpu`` (an eager CPU decode step in one function) computes what the general path computes
    (``paged.absorbed_decode`` around ``mla_decode_cpu``), at the same rounding points: bf16 and fp32, a value
    bias, left-padding starts, an FP8 pool (rows dequantised, the query in the latent's dtype), empty sequences."""
    from types import SimpleNamespace

    from mla_fuser.attention_interfaces.paged import absorbed_decode, joined
    from mla_fuser.kernels.latent_fp8 import quantise_rows
    from mla_fuser.kernels.paged_cpu import absorbed_decode_cpu, mla_decode_cpu

    lens, H, rank, rope, nope, v = [0, 1, 16, 17, 45], 3, 32, 8, 12, 10
    _, kv, bt, sl = make_case(lens, H, rank, rope, 16, dtype, seed=42)
    latent_dtype = dtype
    if fp8:
        kv = quantise_rows(kv[..., :rank].nan_to_num(), kv[..., rank:].nan_to_num())
    g = _seed(43)
    query = torch.randn(len(lens), H, nope + rope, generator=g).to(dtype)
    w_uk, w_uv = torch.randn(H, nope, rank, generator=g).to(dtype), torch.randn(H, v, rank, generator=g).to(dtype)
    b_v = torch.randn(H, v, generator=g).to(dtype) if bias else None
    starts = torch.tensor([0, 0, 5, 16, 30], dtype=torch.int32) if with_starts else None
    got = absorbed_decode_cpu(query, w_uk, w_uv, b_v, kv, bt, sl, 0.3, latent_dtype, starts)
    want = absorbed_decode(query.unsqueeze(2), w_uk, w_uv, b_v, SimpleNamespace(qk_nope_head_dim=nope), latent_dtype,
                           lambda q_lat, q_pe: mla_decode_cpu(joined(q_lat, q_pe), kv, bt, sl, 0.3, rank, starts))
    assert got.dtype == dtype and got.shape == (len(lens), H, v) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want.squeeze(1), atol=0, rtol=0)
    assert torch.equal(got[0], torch.zeros(H, v, dtype=dtype) + (0 if b_v is None else b_v))  # nothing to attend


def test_eager_cpu_decode_step_takes_the_one_function_path(monkeypatch):
    """``paged.paged_decode`` of one token per sequence on CPU pages runs ``absorbed_decode_cpu`` (automatic and the
    torch backend); with the Triton backend (the interpreter) the same step runs the kernel, which agrees."""
    from types import SimpleNamespace

    import mla_fuser.attention_interfaces.paged as paged

    calls = []
    real = paged.absorbed_decode_cpu
    monkeypatch.setattr(paged, "absorbed_decode_cpu", lambda *a: calls.append(1) or real(*a))
    H, rank, rope, nope = 2, 16, 8, 8
    _, kv, bt, sl = make_case([5, 20], H, rank, rope, 8, torch.float32, seed=44)
    view = SimpleNamespace(pages=kv, block_table=bt, seq_lens=sl, new_kv_c=None)
    g = _seed(45)
    query = torch.randn(2, H, 1, nope + rope, generator=g)
    w_uk, w_uv = torch.randn(H, nope, rank, generator=g), torch.randn(H, 4, rank, generator=g)
    m = SimpleNamespace(qk_nope_head_dim=nope, kv_lora_rank=rank)
    outs = []
    for backend in (None, "torch", "triton"):
        if backend:
            monkeypatch.setenv("MLA_FUSER_BACKEND", backend)
        if backend == "triton":
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        outs.append(paged.paged_decode(query, view, 0.3, w_uk, w_uv, None, m))
    assert len(calls) == 2 and all(o.shape == (2, 1, H, 4) for o in outs)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[2], outs[0], atol=1e-5, rtol=1e-5)


def test_decode_dispatch_runs_the_cpu_path_for_cpu_tensors(monkeypatch):
    import mla_fuser.kernels.mla_decode as mod

    calls = []
    original = mod.mla_decode_cpu
    monkeypatch.setattr(mod, "mla_decode_cpu", lambda *a: calls.append(1) or original(*a))
    q, kv, bt, sl = make_case([5, 20], 2, 16, 8, 16, torch.float32, seed=41)
    for backend in (None, "torch"):  # automatic, and the torch backend forced
        if backend:
            monkeypatch.setenv("MLA_FUSER_BACKEND", backend)
        torch.testing.assert_close(md.mla_decode(q, kv, bt, sl, 0.3, 16), md.mla_decode_ref(q, kv, bt, sl, 0.3, 16))
    assert len(calls) == 2


@pytest.mark.parametrize("rope", [8, 0])
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.bfloat16,) * 3,
                                    (torch.float32, torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.float32, torch.float32)])
@pytest.mark.parametrize("new", [1, 5])
def test_cpu_append_matches_ref(rope, dtypes, new):
    """``paged_append_cpu`` writes what the reference writes, bit for bit: ragged lengths crossing page boundaries,
    strided step inputs, a batch of one (the single-copy path), inputs of other dtypes than the pages (the
    reference's rounding: k_pe through kv_c's dtype first)."""
    from mla_fuser.kernels.paged_cpu import paged_append_cpu

    c_dtype, pe_dtype, pages_dtype = dtypes
    g = _seed(42)
    P, ps, r = 10, 4, 32
    for B, lens in ((3, [0, 3, 6]), (1, [2])):
        kv = torch.randn(P, ps, r + rope, generator=g).to(pages_dtype)
        kv_ref = kv.clone()
        table = torch.randperm(P, generator=g)[: B * 3].view(B, 3).to(torch.int32)
        lens_t = torch.tensor(lens, dtype=torch.int32)
        rows = torch.randn(B, new, 1, r + rope + 3, generator=g)[:, :, 0]  # non-contiguous step
        kv_c, k_pe = rows[..., :r].to(c_dtype), rows[..., r:r + rope].to(pe_dtype)
        paged_append_cpu(kv, table, lens_t, kv_c, k_pe)
        pco.paged_append_ref(kv_ref, table, lens_t, kv_c, k_pe)
        assert torch.equal(kv, kv_ref)
        if rope:  # a write wider or narrower than a cache row is refused
            with pytest.raises(ValueError, match="row width"):
                paged_append_cpu(kv, table, lens_t, kv_c, k_pe[..., 1:])


def test_host_tile_helpers_equal_tritons():
    """The launchers size tiles and grids with dispatch's plain-Python helpers (Triton's own are constexpr functions
    whose host calls cost microseconds each, several per launch): same values."""
    triton = pytest.importorskip("triton")
    from mla_fuser.kernels.dispatch import cdiv, next_pow2

    for n in range(1, 3000):
        assert next_pow2(n) == triton.next_power_of_2(n)
        assert cdiv(n, 64) == triton.cdiv(n, 64) and cdiv(n, 7) == triton.cdiv(n, 7)
