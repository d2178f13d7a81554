"""The rotary kernel (``kernels.rotary``) against its torch twin and Transformers' own rotaries, and the rewritten
rotary call (``rotary_call``): the kernel only for calls whose recipe its first run confirmed, the function itself
for everything else.  Triton runs under its interpreter (``TRITON_INTERPRET`` per test); bf16 is compared with a
tolerance there because the interpreter truncates fp32 -> bf16 instead of rounding (fp32 and fp16 are bitwise)."""

import pytest
import torch

import mla_fuser
from conftest import assert_generates_like_native, tiny_deepseek
from mla_fuser.kernels.rotary import RECIPES, rotary_ref, rotary_triton, table_width
from mla_fuser.rotary_call import ROTARY_ATTR, RotaryCall, _agrees, recipe_tables

pytest.importorskip("triton")


def _tables(recipe, batch, tokens, rope, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = table_width(recipe, rope)
    if recipe == "pairs_fp32":
        freqs = torch.polar(torch.ones(batch, tokens, width), torch.randn(batch, tokens, width, generator=g) * 3)
        parts = torch.view_as_real(freqs)
        return parts[..., 0], parts[..., 1]  # strided views, as RotaryCall passes them
    angles = torch.randn(batch, tokens, width, generator=g) * 3
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _qk(batch, heads, tokens, rope, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    # q as the modeling code has it: the rope slice of a [B, T, H, nope + rope] projection, transposed (strided)
    q = torch.randn(batch, tokens, heads, 6 + rope, generator=g).to(dtype)[..., 6:].transpose(1, 2)
    k = torch.randn(batch, 1, tokens, rope, generator=g).to(dtype)
    return q, k


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("table_batch", [1, 2])
def test_kernel_matches_its_twin(interp, recipe, dtype, table_batch):
    q, k = _qk(2, 3, 5, 12, dtype)  # 6 pairs: not a power of two
    cos, sin = _tables(recipe, table_batch, 5, 12, dtype)
    got, want = rotary_triton(q, k, cos, sin, recipe), rotary_ref(q, k, cos, sin, recipe)
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and g_.dtype == w_.dtype and g_.is_contiguous()
        if dtype == torch.bfloat16:  # (the interpreter's truncation: a few bf16 ulps, never more)
            torch.testing.assert_close(g_.float(), w_.float(), rtol=0, atol=4 * 2 ** -8 * w_.float().abs().max().item())
        else:
            assert torch.equal(g_, w_)


def test_kernel_rejects_tables_of_the_wrong_width(interp):
    q, k = _qk(1, 2, 3, 8, torch.float32)
    cos, sin = _tables("halves", 1, 3, 8, torch.float32)
    with pytest.raises(ValueError, match="cos must be"):
        rotary_triton(q, k, cos[..., :4], sin[..., :4], "halves")
    with pytest.raises(ValueError, match="unknown rotary recipe"):
        rotary_triton(q, k, cos, sin, "spiral")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twins_are_transformers_rotaries(dtype):
    """Each recipe's twin computes what the Transformers function it names computes (CPU, torch ops)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (apply_rotary_pos_emb,
                                                                       apply_rotary_pos_emb_interleave)

    q, k = _qk(2, 4, 6, 16, dtype)
    g = torch.Generator().manual_seed(3)
    freqs = torch.polar(torch.ones(2, 6, 8), torch.randn(2, 6, 8, generator=g) * 3)
    angles = torch.randn(2, 6, 8, generator=g) * 3
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    cases = [("pairs_fp32", apply_rotary_emb, (freqs,)), ("pairs_to_halves", apply_rotary_pos_emb_interleave,
                                                           (cos, sin)), ("halves", apply_rotary_pos_emb, (cos, sin))]
    for recipe, fn, tables in cases:
        want = fn(q, k, *tables)
        got = rotary_ref(q, k, *recipe_tables(recipe, q, tables), recipe)
        for g_, w_, x in zip(got, want, (q, k)):
            assert g_.dtype == w_.dtype and g_.shape == w_.shape
            if recipe == "pairs_fp32":  # real products where torch multiplies complex numbers: their rounding only
                assert _agrees(g_, w_, x)
            else:
                assert torch.equal(g_, w_), recipe


def _transformers_rotaries():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (apply_rotary_pos_emb,
                                                                       apply_rotary_pos_emb_interleave)

    return apply_rotary_emb, apply_rotary_pos_emb_interleave, apply_rotary_pos_emb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_call_takes_the_kernel_only_for_a_confirmed_recipe(interp, monkeypatch, dtype):
    import mla_fuser.rotary_call as rc

    v2, v3_interleave, v3_halves = _transformers_rotaries()
    launches = []
    real = rc.rotary
    monkeypatch.setattr(rc, "rotary", lambda *a, **kw: launches.append(a[4]) or real(*a, **kw))
    q, k = _qk(2, 4, 6, 16, dtype)
    g = torch.Generator().manual_seed(5)
    freqs = torch.polar(torch.ones(2, 6, 8), torch.randn(2, 6, 8, generator=g))
    cos, sin = torch.randn(2, 6, 16, generator=g).to(dtype), torch.randn(2, 6, 16, generator=g).to(dtype)
    call = RotaryCall()
    for fn, tables, recipe in ((v2, (freqs,), "pairs_fp32"), (v3_interleave, (cos, sin), "pairs_to_halves"),
                               (v3_halves, (cos, sin), "halves")):
        results = []
        for step in range(2):  # the first call checks, the second runs the kernel: both return the kernel's result
            launches.clear()
            got, want = call(fn, q, k, *tables), fn(q, k, *tables)
            for a, b, x in zip(got, want, (q, k)):
                if recipe == "pairs_fp32":  # real products vs torch's complex ones: their rounding
                    assert _agrees(a, b, x)
                else:
                    assert torch.equal(a, b)
            assert call.verdicts[RotaryCall._kind(fn, q, k, tables)] == recipe
            assert launches == [recipe]  # step 0: the check's own kernel run; step 1: the call's
            results.append(got)
        # the checking call answers as every later call does (a first answer from f could differ in the last bit)
        assert all(torch.equal(a, b) for a, b in zip(*results))

    # a function of the same shape that is no rotary: checked once, then always run itself
    def not_rotary(a, b, c, s):
        return a * 2, b + c.sum()

    for _ in range(2):
        launches.clear()
        got = call(not_rotary, q, k, cos, sin)
        assert torch.equal(got[0], q * 2) and torch.equal(got[1], k + cos.sum())
        assert launches == []  # no recipe's twin agreed, so no kernel was even tried
    assert call.verdicts[RotaryCall._kind(not_rotary, q, k, (cos, sin))] is None

    # a rotary with another pairing (pairs in, pairs out, but rounded per op): no recipe agrees
    def pairs_rounded(a, b, c, s):
        def one(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            cc, ss = c[..., :8].unsqueeze(1), s[..., :8].unsqueeze(1)
            return torch.stack([x1 * cc - x2 * ss, x2 * cc + x1 * ss], -1).flatten(-2)
        return one(a), one(b)

    call(pairs_rounded, q, k, cos, sin)
    assert call.verdicts[RotaryCall._kind(pairs_rounded, q, k, (cos, sin))] is None


def test_call_runs_the_function_on_cpu_without_the_kernel():
    v2, _, _ = _transformers_rotaries()
    q, k = _qk(1, 2, 3, 8, torch.float32)
    freqs = torch.polar(torch.ones(1, 3, 4), torch.randn(1, 3, 4))
    call = RotaryCall()
    got = call(v2, q, k, freqs)
    assert all(torch.equal(a, b) for a, b in zip(got, v2(q, k, freqs))) and call.verdicts == {}


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("interleave", [True, False])
def test_fused_models_rotate_on_the_kernel_and_equal_native(interp, monkeypatch, arch, interleave):
    if arch == "deepseek_v2" and not interleave:
        pytest.skip("DeepSeek-V2 has one rotary")
    import mla_fuser.rotary_call as rc

    launches, joins = [], []
    real = rc.rotary
    monkeypatch.setattr(rc, "rotary", lambda *a, **kw: launches.append(a[4]) or joins.append("q_nope" in kw)
                        or real(*a, **kw))
    extra = {} if arch == "deepseek_v2" else {"rope_interleave": interleave}
    native = tiny_deepseek(arch=arch, layers=2, **extra)
    fused = tiny_deepseek(arch=arch, attn="vllm_mla", layers=2, **extra)
    mla_fuser.fuse(fused)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    assert_generates_like_native(native, fused, ids, 5)
    recipe = "pairs_fp32" if arch == "deepseek_v2" else ("pairs_to_halves" if interleave else "halves")
    verdicts = getattr(fused.model.layers[0].self_attn, ROTARY_ATTR).verdicts
    assert list(verdicts.values()) == [recipe]
    assert launches.count(recipe) > 5  # every later call of every layer ran the kernel
    # from each layer's third call on, the launch also joined the query (the forward's cat is gone)
    assert joins.count(True) >= len(joins) - 3 * 2 > 0


def test_rotary_rewrite_skips_calls_of_other_shapes():
    """Only ``a, b = f(a, b, *rest)`` is routed: another assignment shape stays as written."""
    import libcst as cst

    from mla_fuser.rewrite import _rotary_calls

    source = (
        "def forward(self, x, q, k, c, s):\n"
        "    q, k = rope(q, k, c, s)\n"          # routed
        "    k, q = rope(q, k, c, s)\n"          # names swapped
        "    q, k = self.rope(q, k, c, s)\n"     # a method: module state
        "    q, k = rope(q, k)\n"                # no tables
        "    q, k = rope(q, k, c, s=s)\n"        # keyword
        "    q, k = rope(q, k, *c)\n"            # star
        "    return q, k\n"
    )
    func = cst.parse_module(source).body[0]
    calls = _rotary_calls(func)
    assert len(calls) == 1 and cst.Module(body=[]).code_for_node(calls[0]) == "rope(q, k, c, s)"


def _split_query(batch, heads, tokens, nope, rope, dtype, seed=1):
    """``(q_nope, q_pe)`` as an MLA forward has them: ``torch.split`` of a transposed ``[B, T, H, nope + rope]``
    projection (views of one storage, the rope columns right after the nope ones)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, nope + rope, generator=g).to(dtype).transpose(1, 2)
    return torch.split(q, [nope, rope], dim=-1)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_the_joined_query_in_the_same_launch(monkeypatch, recipe, dtype):
    """Compiled on a GPU when there is one (bf16 within a rounding of the twin there), else interpreted."""
    on_gpu = torch.cuda.is_available()
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    if not on_gpu:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dev = "cuda" if on_gpu else "cpu"
    q_nope, q_pe = (t.to(dev) for t in _split_query(2, 3, 5, 10, 12, dtype))
    k = torch.randn(2, 1, 5, 12).to(dev, dtype)
    cos, sin = (t.to(dev) for t in _tables(recipe, 2, 5, 12, dtype))
    joined, k_out = rotary_triton(q_pe, k, cos, sin, recipe, q_nope=q_nope)
    want_q, want_k = rotary_ref(q_pe, k, cos, sin, recipe)
    assert joined.shape == (2, 3, 5, 22) and joined.is_contiguous()
    assert torch.equal(joined[..., :10], q_nope)  # copied, not computed
    for got, want in ((joined[..., 10:], want_q), (k_out, want_k)):
        if dtype == torch.bfloat16 or on_gpu:  # (the interpreter's truncation as above; compiled fma/sincos order)
            ulps = 4 * 2 ** -8 if dtype == torch.bfloat16 else 2 ** -20
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=ulps * want.float().abs().max().item())
        else:
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match="does not go with"):
        rotary_triton(q_pe, k, cos, sin, recipe, q_nope=q_nope[:, :2])


def _join_steps(call, fn, q_nope, q_pe, k, tables, between=None):
    """One forward's two calls: ``before_join``, then ``join`` (``between`` runs in between); returns the joined
    query and what ``torch.cat`` gives on the same operands then."""
    rot, _ = call.before_join(fn, q_pe, k, *tables)
    if between is not None:
        between(q_nope, rot)
    want = torch.cat((q_nope, rot), dim=-1)
    return call.join(torch.cat, (q_nope, rot), dim=-1), want, rot


def test_join_returns_the_kernels_joined_query_only_where_it_equals_the_cat(interp, monkeypatch):
    import mla_fuser.rotary_call as rc

    v2, _, _ = _transformers_rotaries()
    launches = []
    real = rc.rotary
    monkeypatch.setattr(rc, "rotary", lambda *a, **kw: launches.append("q_nope" in kw) or real(*a, **kw))
    q_nope, q_pe = _split_query(2, 4, 3, 6, 8, torch.float32)
    k = torch.randn(2, 1, 3, 8)
    freqs = torch.polar(torch.ones(2, 3, 4), torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(2)))
    call = RotaryCall()
    kind = RotaryCall._kind(v2, q_pe, k, (freqs,))
    # call 1 identifies the recipe, call 2 learns where q_nope lies (both joined by torch.cat), call 3 on joins in
    # the rotary's launch: the join hands back the rotary's own buffer, equal to the cat
    for step in range(4):
        launches.clear()
        got, want, rot = _join_steps(call, v2, q_nope, q_pe, k, (freqs,))
        assert torch.equal(got, want)
        assert call.nope_widths.get(kind) == (None if step == 0 else 6)
        joined = step >= 2
        assert (rot._base is got) == joined and launches == [joined]
    # q_nope written in place after the rotary: the cat runs on the new values
    got, want, _ = _join_steps(call, v2, q_nope.clone(), q_pe, k, (freqs,))  # another tensor: not the adjacent one
    assert torch.equal(got, want)
    q_nope2, q_pe2 = _split_query(2, 4, 3, 6, 8, torch.float32, seed=4)
    got, want, rot = _join_steps(call, v2, q_nope2, q_pe2, k, (freqs,), between=lambda n, r: n.mul_(3))
    assert torch.equal(got, want) and rot._base is not got
    got, want, rot = _join_steps(call, v2, q_nope2, q_pe2, k, (freqs,), between=lambda n, r: r.add_(1))
    assert torch.equal(got, want) and rot._base is not got
    # another dim, or a cat of something else: the cat as written
    rot, _ = call.before_join(v2, q_pe2, k, freqs)
    assert torch.equal(call.join(torch.cat, (q_nope2, rot), -1), torch.cat((q_nope2, rot), -1))
    rot, _ = call.before_join(v2, q_pe2, k, freqs)
    other = torch.cat((rot, rot), dim=1)
    assert torch.equal(call.join(torch.cat, (rot, rot), dim=1), other)
    # a plain call (no join after it) never joins
    launches.clear()
    call(v2, q_pe2, k, freqs)
    assert launches == [False]


def test_join_does_not_join_inference_tensors(interp):
    v2, _, _ = _transformers_rotaries()
    freqs = torch.polar(torch.ones(1, 3, 4), torch.randn(1, 3, 4))
    call = RotaryCall()
    with torch.inference_mode():  # (no version counters to prove the operands unchanged)
        q_nope, q_pe = _split_query(1, 2, 3, 6, 8, torch.float32)
        k = torch.randn(1, 1, 3, 8)
        for _ in range(3):
            got, want, rot = _join_steps(call, v2, q_nope, q_pe, k, (freqs,))
            assert torch.equal(got, want) and rot._base is not got


def test_rewrite_joins_only_a_single_last_dim_cat_of_the_rotated_query():
    import libcst as cst

    from mla_fuser.rewrite import _joining_cat, _rotary_calls

    def joined(lines):
        source = "def forward(self, q, k, n, c):\n    q, k = rope(q, k, c)\n" + "".join(f"    {x}\n" for x in lines)
        func = cst.parse_module(source).body[0]
        calls = _rotary_calls(func)
        cat = _joining_cat(list(func.body.body), calls[0], calls)
        return None if cat is None else cst.Module(body=[]).code_for_node(cat)

    assert joined(["x = torch.cat((n, q), dim=-1)", "return x"]) == "torch.cat((n, q), dim=-1)"
    assert joined(["x = torch.cat([n, q], -1)", "return x"]) == "torch.cat([n, q], -1)"
    assert joined(["q = q * 2", "x = torch.cat((n, q), dim=-1)"]) is None  # another use first
    assert joined(["x = torch.cat((n, q), dim=-1)", "return x, q"]) is None  # two uses
    assert joined(["x = torch.cat((q, n), dim=-1)"]) is None  # the rotated part first
    assert joined(["x = torch.cat((n, q), dim=1)"]) is None
    assert joined(["x = torch.cat((n, q))"]) is None  # dim 0
    assert joined(["x = torch.cat((n, q, n), dim=-1)"]) is None
    assert joined(["x = torch.cat((*n, q), dim=-1)"]) is None
    assert joined(["x = other.cat((n, q), dim=-1)"]) is None
    assert joined(["n = torch.cat((n, n), dim=-1)", "x = torch.cat((n, q), dim=-1)"]) == "torch.cat((n, q), dim=-1)"
    assert joined(["q = k", "x = torch.cat((n, q), dim=-1)"]) is None  # q reassigned first: not the rotated one
    # DeepSeek-V3's shape: one of two rotaries chosen by an ``if``; another use inside the ``if`` is a use
    two = ("    if c:\n        q, k = rope(q, k, c)\n    else:\n        q, k = other(q, k, c)\n{}"
           "    x = torch.cat((n, q), -1)\n")
    for extra, want in (("", "torch.cat((n, q), -1)"), ("        y = q + 1\n", None)):
        func = cst.parse_module("def forward(self, q, k, n, c):\n" + two.format(extra)).body[0]
        calls = _rotary_calls(func)
        assert len(calls) == 2
        for call in calls:
            cat = _joining_cat(list(func.body.body), call, calls)
            assert (None if cat is None else cst.Module(body=[]).code_for_node(cat)) == want
