"""The paged MLA decode's TMA kernel (``kernels/mla_decode_tma.py``) against the reference and ``mla_decode``'s own
kernel, under Triton's interpreter (which stands in for a GPU with TMA and reads host tensor descriptors).

The caches come from ``test_kernel_mla_decode.make_case``: NaN in every row no sequence owns, rows past each
sequence's end included, so the kernel's cut tiles must keep those rows out of the maths (boxes shifted so that TMA
reads zeros there, scores masked).  bf16 dots are upcast under the interpreter (see that file's docstring); the
compiled test at the end (a Hopper GPU) and ``bench_mla_decode_kernel.py --tma-ab`` run the compiled kernel.
"""

from __future__ import annotations

import pytest
import torch

from mla_fuser.kernels import mla_decode as md
from mla_fuser.kernels import mla_decode_tma
from mla_fuser.kernels.tma import HAS_HOST_TENSOR_DESCRIPTORS

from test_kernel_mla_decode import _check, _ref32, _with_starts_naive, make_case

DEFAULT_ENABLED = mla_decode_tma.ENABLED  # (read when this file is imported, before any test sets it)

pytestmark = pytest.mark.skipif(not HAS_HOST_TENSOR_DESCRIPTORS,
                                reason="this Triton has no host tensor descriptors (3.4 on)")


@pytest.fixture(autouse=True)
def tma_on(monkeypatch):
    """The kernel on for these tests whatever ``MLA_FUSER_DECODE_TMA`` says (``mla_decode_tma.ENABLED``)."""
    monkeypatch.setattr(mla_decode_tma, "ENABLED", True)


def _both_kernels(monkeypatch, *args, **kwargs):
    """``mla_decode``'s output with the TMA kernel (asserting it ran) and with it turned off."""
    out = md.mla_decode(*args, **kwargs)
    assert md.LAST_LAUNCH["config"].tma, "the TMA kernel did not run"
    monkeypatch.setattr(mla_decode_tma, "ENABLED", False)
    plain = md.mla_decode(*args, **kwargs)
    assert not md.LAST_LAUNCH["config"].tma
    monkeypatch.setattr(mla_decode_tma, "ENABLED", True)
    return out, plain


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
@pytest.mark.parametrize("r,rope", [(512, 64), (256, 32), (512, 0)])
def test_tma_kernel_equals_the_reference_over_ragged_pages(interp, monkeypatch, dtype, num_splits, r, rope):
    """Lengths 0, 1, one page exactly, a page and one row, a tile and a partial one; 16 and 5 heads (a masked
    head tile); DeepSeek's, MiniCPM3's and a NoPE latent; splits of one tile, several, and empty ones; pages of one
    tile (16 heads) and of two (5 heads: a cut tile in a page's second half)."""
    for H in (16, 5):
        q, kv, bt, sl = make_case([0, 1, 64, 65, 150, 200], H, r, rope, 64 if H == 16 else 128, dtype,
                                  seed=H + r + rope)
        out, plain = _both_kernels(monkeypatch, q, kv, bt, sl, 0.05, r, num_splits=num_splits)
        ref = _ref32(q, kv, bt, sl, 0.05, r)
        _check(out, ref, dtype)
        assert (out[0] == 0).all()
        torch.testing.assert_close(out.float(), plain.float(), atol=2e-2, rtol=2e-2)


LEFT_PADDED_LENS = [70, 130, 200, 9, 40, 130, 64]
LEFT_PADDED_STARTS = [5, 64, 97, 0, 5, 100, 63]


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("page_size", [64, 128])
def test_tma_kernel_with_left_padding(interp, monkeypatch, num_splits, page_size):
    """Starts inside the first tile, on a tile boundary, past a whole tile, at 0; a sequence that starts and ends
    inside one tile (read from pointers), a first tile cut at its start followed by a last one of two rows, one token
    at a tile's last row; pages of one tile and of two.  The rows before each start are NaN, so a box that let one of
    them into the maths would show."""
    starts = torch.tensor(LEFT_PADDED_STARTS, dtype=torch.int32)
    q, kv, bt, sl = make_case(LEFT_PADDED_LENS, 16, 256, 32, page_size, torch.bfloat16, seed=7)
    want, kv = _with_starts_naive(q.float(), kv.float(), bt, sl, starts, 0.1, 256)
    out, plain = _both_kernels(monkeypatch, q, kv.to(torch.bfloat16), bt, sl, 0.1, 256, num_splits=num_splits,
                               starts=starts)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), plain.float(), atol=2e-2, rtol=2e-2)


def test_tma_kernel_with_the_rope_part_apart(interp, monkeypatch):
    """The query's rope part as a tensor of its own (``q_rope``), strided, equals the joined query."""
    q, kv, bt, sl = make_case([33, 128], 16, 512, 64, 64, torch.bfloat16, seed=3)
    joined = md.mla_decode(q, kv, bt, sl, 0.05, 512)
    wide = torch.zeros(2, 16, 80, dtype=q.dtype)
    wide[..., :64] = q[..., 512:]
    out, _ = _both_kernels(monkeypatch, q[..., :512], kv, bt, sl, 0.05, 512, q_rope=wide[..., :64])
    torch.testing.assert_close(out, joined, atol=0, rtol=0)


@pytest.mark.parametrize("case", ["page16", "fp32", "width320", "rope48", "heads20", "config", "strided_pool"])
def test_what_the_tma_kernel_does_not_take_runs_mla_decodes_own(interp, case):
    """Pages smaller than its 64-token tiles, fp32, a value width other than 256 or 512, a rope part that is not a
    power of two, more than 16 heads, a config the caller gives, and a pool not contiguous: ``mla_decode``'s own
    kernel runs, and the result is right."""
    H, r, rope, ps, dtype = 16, 512, 64, 64, torch.bfloat16
    if case == "page16":
        ps = 16
    elif case == "fp32":
        dtype = torch.float32
    elif case == "width320":
        r = 320
    elif case == "rope48":
        rope = 48
    elif case == "heads20":
        H = 20
    q, kv, bt, sl = make_case([70, 3], H, r, rope, ps, dtype, seed=5)
    config = md.MLADecodeConfig(block_h=16, block_n=64) if case == "config" else None
    if case == "strided_pool":
        kv = torch.cat([kv, torch.zeros_like(kv)], dim=-1)[..., : r + rope]
        assert not kv.is_contiguous()
    if config is None:
        out = md.mla_decode(q, kv, bt, sl, 0.05, r)
    else:
        out = md.mla_decode_triton(q, kv, bt, sl, 0.05, r, config=config)
    assert not md.LAST_LAUNCH["config"].tma
    _check(out, _ref32(q, kv, bt, sl, 0.05, r), dtype)


def test_usable_reads_the_layout_not_names():
    """What ``usable`` asks of a call: on a CPU tensor without the interpreter there is no TMA to use."""
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    assert not mla_decode_tma.usable(q, kv, 512, 64, False)  # (no TRITON_INTERPRET here: no TMA)


def test_usable_under_the_interpreter(interp):
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    assert mla_decode_tma.usable(q, kv, 512, 64, False)
    assert not mla_decode_tma.usable(q, kv, 512, 64, True)  # rows that look their pages up one by one
    assert not mla_decode_tma.usable(q.float(), kv.float(), 512, 64, False)
    assert not mla_decode_tma.usable(q, kv, 448, 128, False)
    assert not mla_decode_tma.usable(q[..., :520], kv[..., :520].contiguous(), 512, 8, False)  # rope under 16
    assert not mla_decode_tma.usable(q, kv[..., :512], 512, 0, False)  # a pool whose rows are not contiguous
    assert mla_decode_tma.usable(q[..., :512], torch.zeros(2, 64, 512, dtype=torch.bfloat16), 512, 0, False)


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_the_setting_turns_it_on_and_off(interp, monkeypatch, value, on):
    """On by default, ``MLA_FUSER_DECODE_TMA=0`` (or another off word) runs ``mla_decode``'s own kernel; the result is
    right either way.  ``ENABLED`` is None unless a process sets it, and then wins over the setting."""
    assert DEFAULT_ENABLED is None
    monkeypatch.setattr(mla_decode_tma, "ENABLED", DEFAULT_ENABLED)
    if value is None:
        monkeypatch.delenv("MLA_FUSER_DECODE_TMA", raising=False)
    else:
        monkeypatch.setenv("MLA_FUSER_DECODE_TMA", value)
    q, kv, bt, sl = make_case([70], 16, 512, 64, 64, torch.bfloat16, seed=9)
    out = md.mla_decode(q, kv, bt, sl, 0.05, 512)
    assert md.LAST_LAUNCH["config"].tma is on
    _check(out, _ref32(q, kv, bt, sl, 0.05, 512), torch.bfloat16)
    monkeypatch.setattr(mla_decode_tma, "ENABLED", not on)
    md.mla_decode(q, kv, bt, sl, 0.05, 512)
    assert md.LAST_LAUNCH["config"].tma is (not on)


def test_a_bad_setting_is_an_error(interp, monkeypatch):
    from mla_fuser.envs import SettingError

    monkeypatch.setattr(mla_decode_tma, "ENABLED", None)
    monkeypatch.setenv("MLA_FUSER_DECODE_TMA", "maybe")
    q, kv, bt, sl = make_case([70], 16, 512, 64, 64, torch.bfloat16, seed=9)
    with pytest.raises(SettingError, match="MLA_FUSER_DECODE_TMA"):
        md.mla_decode(q, kv, bt, sl, 0.05, 512)


def test_pool_descriptors_are_built_once_per_pool_and_go_with_it(interp):
    """The descriptors a pool's calls share: built on the first call, the same objects on the next, rebuilt for other
    boxes or when the pool moves in place, and the entry dropped when the caller lets the pool go (the descriptors
    hold an alias of its storage, not a view that would keep the pool alive)."""
    import gc

    kv = torch.zeros(3, 64, 576, dtype=torch.bfloat16)
    first = mla_decode_tma.pool_descriptors(kv, 64, 256, 64)
    again = mla_decode_tma.pool_descriptors(kv, 64, 256, 64)
    assert again[0] is first[0] and again[1] is first[1]
    assert first[0].base.data_ptr() == kv.data_ptr() and first[0].base._base is None
    assert list(first[0].shape) == [3, 64, 576] and list(first[1].block_shape) == [1, 64, 64]  # slots of 64 rows
    assert mla_decode_tma.pool_descriptors(kv, 32, 256, 64)[0] is not first[0]  # other boxes
    kv.set_(torch.zeros(4, 64, 576, dtype=torch.bfloat16).untyped_storage(), 0, (4, 64, 576))  # moved in place
    moved = mla_decode_tma.pool_descriptors(kv, 32, 256, 64)
    assert list(moved[0].shape) == [8, 32, 576] and moved[0].base.data_ptr() == kv.data_ptr()
    key = id(kv)
    assert key in mla_decode_tma._POOL_DESCRIPTORS
    del kv, first, again, moved
    gc.collect()
    assert key not in mla_decode_tma._POOL_DESCRIPTORS


def test_a_pool_read_twice_gives_the_same_output_from_its_kept_descriptors(interp, monkeypatch):
    """Two calls over one pool (the second on the kept descriptors), after the pool's rows changed in place: the
    second call reads the new rows."""
    q, kv, bt, sl = make_case([70, 9], 16, 512, 64, 64, torch.bfloat16, seed=11)
    md.mla_decode(q, kv, bt, sl, 0.05, 512)
    assert md.LAST_LAUNCH["config"].tma
    kv.mul_(0.5)
    out, plain = _both_kernels(monkeypatch, q, kv, bt, sl, 0.05, 512)
    _check(out, _ref32(q, kv, bt, sl, 0.05, 512), torch.bfloat16)
    torch.testing.assert_close(out.float(), plain.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="the compiled kernel needs a Hopper GPU (TMA)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
def test_cuda_compiled_tma_kernel_over_ragged_pages_and_left_padding(monkeypatch, dtype, num_splits):
    """The compiled kernel (no interpreter) on the cases above: NaN garbage past each end and before each start,
    ragged lengths, 16 and 5 heads, DeepSeek's and MiniCPM3's latents, against the fp32 reference and the
    pointer kernel."""
    for H, r, rope in ((16, 512, 64), (5, 512, 64), (16, 256, 32)):
        q, kv, bt, sl = make_case([0, 1, 64, 65, 150, 3000], H, r, rope, 128 if H == 5 else 64, dtype, seed=H + r)
        q, kv, bt, sl = q.cuda(), kv.cuda(), bt.cuda(), sl.cuda()
        out, plain = _both_kernels(monkeypatch, q, kv, bt, sl, 0.05, r, num_splits=num_splits)
        _check(out, _ref32(q, kv, bt, sl, 0.05, r), dtype)
        assert (out[0] == 0).all()
        torch.testing.assert_close(out.float(), plain.float(), atol=2e-2, rtol=2e-2)
    starts = torch.tensor(LEFT_PADDED_STARTS, dtype=torch.int32)
    q, kv, bt, sl = make_case(LEFT_PADDED_LENS, 16, 512, 64, 64, dtype, seed=7)
    want, kv = _with_starts_naive(q.float(), kv.float(), bt, sl, starts, 0.1, 512)
    out, plain = _both_kernels(monkeypatch, q.cuda(), kv.to(dtype).cuda(), bt.cuda(), sl.cuda(), 0.1, 512,
                               num_splits=num_splits, starts=starts.cuda())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), plain.float(), atol=2e-2, rtol=2e-2)
