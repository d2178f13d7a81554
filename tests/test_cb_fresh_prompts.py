"""Fresh prompts of a continuous-batching step attended expanded: the step's new latent rows expanded through
``kv_b_proj``, causal varlen attention over the packed new tokens (``kernels.varlen_attention``), the absorbed
kernel reading one row for those tokens (``ragged.fresh_bounds``); decode tokens and chunks after a cached prefix
stay absorbed."""

import pytest
import torch
import torch.nn.functional as F

from test_continuous_batching import _cb_config, _check_batch, _greedy, _pair, _prompts, needs_cb


def _per_sequence(q, k, v, cu, scale):
    """Each sequence of ``cu`` by itself through SDPA, causal (what the varlen attention must equal)."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1])
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                      v[a:b].transpose(0, 1), is_causal=True,
                                                      scale=scale).transpose(0, 1)
    return out


def test_varlen_twin_attends_each_sequence_causally_by_itself():
    """Sequences of 5, 0 (an engine's padding sequence), 1 and 3 tokens, then two padding tokens past the last:
    every real row equals its sequence attended alone; the padding rows are finite."""
    from mla_fuser.kernels.varlen_attention import varlen_causal_attention, varlen_causal_attention_ref

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(11, 3, 24, generator=gen), torch.randn(11, 3, 24, generator=gen)
    v = torch.randn(11, 3, 16, generator=gen)  # (values narrower than the query, as DeepSeek's)
    cu = torch.tensor([0, 5, 5, 6, 9], dtype=torch.int32)
    want = _per_sequence(q, k, v, cu, 0.3)
    got = varlen_causal_attention_ref(q, k, v, cu, 0.3)
    torch.testing.assert_close(got[:9], want[:9], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(varlen_causal_attention(q, k, v, cu, 11, 0.3), got)  # (on a CPU: the twin)


def test_fresh_bounds_cut_only_fresh_prompts():
    """Requests (cached, new): a fresh 3-token prompt, a decode token after 4 rows, a chunk of 2 after 3 cached rows,
    a fresh 1-token prompt, then an empty padding sequence and a padding token: only the fresh prompts' tokens are
    flagged, cut to their context's first row; every other token keeps ``token_bounds``'."""
    from mla_fuser.attention_interfaces import ragged

    cu_q = torch.tensor([0, 3, 4, 6, 7, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 8, 13, 14, 14], dtype=torch.int32)
    starts, ends = ragged.token_bounds(cu_q, cu_k, 8)
    f_starts, f_ends, fresh = ragged.fresh_bounds(cu_q, cu_k, 8)
    assert fresh.tolist() == [True, True, True, False, False, False, True, False]
    assert torch.equal(f_starts, starts)
    assert ends.tolist() == [1, 2, 3, 8, 12, 13, 14, 1]
    assert f_ends.tolist() == [1, 1, 1, 8, 12, 13, 14, 1]


def _step(gen, requests, heads=4, rank=32, rope=8, nope=16, v_dim=16, pad=2):
    """A step of ``requests`` [(cached, new)]: K / V half rows of every context at scattered slots, ``kv_b_proj``'s
    weight, queries, ``cu_q`` / ``cu_k`` (``pad`` padding tokens past the last request)."""
    from mla_fuser.kernels.mla_decode_split import join_split_rows

    total = sum(c + n for c, n in requests)
    pool = torch.randn(2 * total + 8, (rank + rope) // 2, generator=gen)  # (V halves 8 slots on)
    k_rows, v_rows = pool[:-8], pool[8:]
    slots = torch.randperm(2 * total, generator=gen)[:total]  # (each context row's slot, scattered)
    w = torch.randn(heads * (nope + v_dim), rank, generator=gen) * rank ** -0.5
    cu_q, cu_k = [0], [0]
    for cached, new in requests:
        cu_q.append(cu_q[-1] + new)
        cu_k.append(cu_k[-1] + cached + new)
    tokens = cu_q[-1] + pad
    q = torch.randn(1, heads, tokens, nope + rope, generator=gen)
    latent = join_split_rows(k_rows[slots], v_rows[slots], rank)  # every context row, in request order
    new_rows = torch.cat([latent[cu_k[i + 1] - n:cu_k[i + 1]] for i, (_, n) in enumerate(requests)]
                         + [latent[:pad]])  # (the padding tokens' rows: any)
    as32 = dict(dtype=torch.int32)
    return (k_rows, v_rows, slots, w, q, new_rows, torch.tensor(cu_q, **as32), torch.tensor(cu_k, **as32),
            (heads, rank, rope, nope, v_dim))


def _attend(step, expand_with=None):
    """``ragged_mla_attention_in_pages`` on ``step`` with the absorbed twin for ``decode_rows`` and, unless
    ``expand_with`` is None, ``expand_with(q, key, value, cu_q, scale)`` over the new rows expanded."""
    from mla_fuser.attention_interfaces import ragged
    from mla_fuser.kernels.mla_decode_split import mla_decode_split_rows_ref

    k_rows, v_rows, slots, w, q, new_rows, cu_q, cu_k, (heads, rank, rope, nope, v_dim) = step
    scale = (nope + rope) ** -0.5
    w_h = w.view(heads, nope + v_dim, rank)
    w_uk, w_uv = w_h[:, :nope], w_h[:, nope:]

    def decode_rows(queries, ends, starts, bases):
        q_lat = torch.einsum("thn,hnr->thr", queries[:, :, 0, :nope], w_uk)
        out = mla_decode_split_rows_ref(torch.cat([q_lat, queries[:, :, 0, nope:]], -1), k_rows, v_rows, slots,
                                        ends, starts, scale, rank)
        return torch.einsum("thr,hvr->thv", out, w_uv).unsqueeze(1)

    def expand(cu):
        kv = (new_rows[:, :rank] @ w.T).view(-1, heads, nope + v_dim)
        key = torch.cat([kv[..., :nope], new_rows[:, None, rank:].expand(-1, heads, -1)], -1)
        return expand_with(q[0].transpose(0, 1), key, kv[..., nope:], cu, scale)

    return ragged.ragged_mla_attention_in_pages(decode_rows, q, cu_q, cu_k, 0,
                                                None if expand_with is None else expand)


@pytest.mark.parametrize("seed", [0, 1])
def test_fresh_prompts_expanded_equal_the_absorbed_kernel(seed):
    """A step of fresh prompts (7 and 1 tokens), a decode token, a chunk after a cached prefix: attended with the fresh
    prompts expanded, every real token's output equals the all-absorbed step's; with an expansion that returns zeros,
    exactly the fresh prompts' tokens are zero (their output comes from the expansion, the rest from the kernel)."""
    from mla_fuser.kernels.varlen_attention import varlen_causal_attention

    step = _step(torch.Generator().manual_seed(seed), [(0, 7), (9, 1), (6, 4), (0, 1)])
    real = int(step[6][-1])
    absorbed = _attend(step)
    expanded = _attend(step, lambda q, k, v, cu, s: varlen_causal_attention(q, k, v, cu, q.shape[0], s))
    torch.testing.assert_close(expanded[:, :real], absorbed[:, :real], rtol=1e-5, atol=1e-5)
    zeroed = _attend(step, lambda q, k, v, cu, s: torch.zeros(q.shape[0], q.shape[1], v.shape[-1]))
    fresh = torch.tensor([True] * 7 + [False] * 5 + [True])
    assert (zeroed[0, :real][fresh] == 0).all()
    assert (zeroed[0, :real][~fresh].abs().amax(dim=(1, 2)) > 0).all()
    torch.testing.assert_close(zeroed[0, :real][~fresh], absorbed[0, :real][~fresh])


@needs_cb
@pytest.mark.parametrize("expand", [True, False])
def test_generate_batch_with_fresh_prompts_expanded_equals_native(monkeypatch, device_path, expand):
    """Through the engine (device path on CPU tensors, rows read in place): prompts that start fresh, a prompt of 37
    tokens whose later chunks (16 tokens a step) follow a cached prefix, decode tokens beside them: tokens equal
    native's with fresh prompts expanded (the varlen attention ran, over steps holding fresh prompts) and with every
    token absorbed (``EXPAND_FRESH_PROMPTS = False``: it never ran)."""
    from mla_fuser.attention_interfaces import ragged, vllm_mla

    monkeypatch.setattr(ragged, "EXPAND_FRESH_PROMPTS", expand)
    fresh_tokens, real = [], vllm_mla.varlen_causal_attention
    real_bounds = ragged.fresh_bounds

    def counted(*a):
        out = real_bounds(*a)
        fresh_tokens.append(int(out[2].sum()))
        return out

    calls = []
    monkeypatch.setattr(vllm_mla, "varlen_causal_attention", lambda *a: calls.append(a[3]) or real(*a))
    monkeypatch.setattr(ragged, "fresh_bounds", counted)
    native, fused = _pair(kv_lora_rank=32)
    _check_batch(native, fused, _prompts([37, 5, 9, 2], seed=3), _greedy(5), _cb_config(max_batch_tokens=16))
    assert set(device_path) == {"pages"}
    if expand:
        assert calls and max(fresh_tokens) > 1  # fresh prompts of several tokens were attended expanded
        assert min(fresh_tokens) == 0  # and steps without any (decode, later chunks) took the same path
    else:
        assert not calls and not fresh_tokens
