"""Toy modules with arbitrary child names, for matcher and rewrite tests."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward


class Scaler(nn.Module):
    """An RMSNorm under another name: x * rsqrt(mean(x^2) + eps) * weight."""

    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.gain * x.to(dtype)


class Centerer(nn.Module):
    """A LayerNorm-like module (subtracts the mean): must not count as RMSNorm."""

    def __init__(self, width):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.gain * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def toy_config(attn="sdpa"):
    cfg = PretrainedConfig()
    cfg._attn_implementation = attn
    return cfg


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Wobble(nn.Module):
    """MLA under arbitrary names: alpha/beta/gamma = q-LoRA, delta/epsilon/zeta = KV, omega = output."""

    def __init__(self, hidden=32, heads=2, q_rank=24, rank=16, rope=4, nope=8, v=6, q_lora=True, config=None):
        super().__init__()
        self.config = config or toy_config()
        self.heads, self.rank, self.rope, self.nope, self.v = heads, rank, rope, nope, v
        self.use_lora = q_lora
        self.layer_idx = 0
        self.is_causal = True
        if q_lora:
            self.alpha = nn.Linear(hidden, q_rank, bias=False)
            self.beta = Scaler(q_rank)
            self.gamma = nn.Linear(q_rank, heads * (nope + rope), bias=False)
        else:
            self.kappa = nn.Linear(hidden, heads * (nope + rope), bias=False)
        self.delta = nn.Linear(hidden, rank + rope, bias=False)
        self.epsilon = Scaler(rank)
        self.zeta = nn.Linear(rank, heads * (nope + v), bias=False)
        self.omega = nn.Linear(heads * v, hidden, bias=False)
        self.scale = (nope + rope) ** -0.5

    def unfold(self, lat, rot):
        b, _, t, _ = lat.shape
        kv = self.zeta(lat).view(b, t, self.heads, self.nope + self.v).transpose(1, 2)
        k_nope, val = kv.split([self.nope, self.v], dim=-1)
        key = torch.cat([k_nope, rot.expand(-1, self.heads, -1, -1)], dim=-1)
        return key, val

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, **kwargs):
        b, s, _ = hidden_states.shape
        if self.use_lora:
            q = self.gamma(self.beta(self.alpha(hidden_states)))
        else:
            q = self.kappa(hidden_states)
        q = q.view(b, s, self.heads, -1).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        compressed = self.delta(hidden_states)
        lat, rot = compressed.split([self.rank, self.rope], dim=-1)
        lat = self.epsilon(lat).view(b, 1, s, self.rank)
        rot = rot.view(b, 1, s, self.rope)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_rot, rot = rotate(q_rot, cos, sin), rotate(rot, cos, sin)
        query = torch.cat([q_nope, q_rot], dim=-1)
        key, value = self.unfold(lat, rot)
        attn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attn(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scale, **kwargs)
        return self.omega(out.reshape(b, s, -1))


def toy_rope(batch, seq, rope, offset=0):
    pos = torch.arange(offset, offset + seq, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
    freqs = torch.outer(pos, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().expand(batch, -1, -1), emb.sin().expand(batch, -1, -1)


class GluMlp(nn.Module):
    def __init__(self, hidden=32, inter=64):
        super().__init__()
        self.a = nn.Linear(hidden, inter, bias=False)
        self.b = nn.Linear(hidden, inter, bias=False)
        self.c = nn.Linear(inter, hidden, bias=False)
        self.n = Scaler(hidden)

    def forward(self, x):
        x = self.n(x)
        return self.c(nn.functional.silu(self.a(x)) * self.b(x))


class TwoNorms(nn.Module):
    """Two rmsnorm(linear(x)) chains of equal widths and no KV chain: not MLA."""

    def __init__(self, hidden=32, width=16):
        super().__init__()
        self.p = nn.Linear(hidden, width, bias=False)
        self.pn = Scaler(width)
        self.q = nn.Linear(hidden, width, bias=False)
        self.qn = Scaler(width)
        self.r = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.r(self.pn(self.p(x)) * self.qn(self.q(x)))


class CenteredKv(Wobble):
    """Wobble whose KV norm subtracts the mean (LayerNorm-like): its KV chain is not an RMSNorm chain."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.epsilon = Centerer(self.rank)


# ---------------------------------------------------------------- attention computed inline (no interface call)


class Ripple(nn.Module):
    """MLA that computes attention itself, as modeling files shipped for ``trust_remote_code`` do, under arbitrary
    names: iota/theta/sigma = q-LoRA (or psi = query projection without), rho/tau/phi = KV down-projection, latent
    norm and up-projection, chi = output.  ``attend``: "matmul" (scores, softmax and mix inline) or "sdpa"
    (``F.scaled_dot_product_attention`` called directly); ``rope=0`` is NoPE."""

    def __init__(self, hidden=32, heads=2, q_rank=24, rank=16, rope=4, nope=8, v=6, q_lora=True, attend="matmul",
                 config=None):
        super().__init__()
        self.config = config or toy_config()
        self.heads, self.rank, self.rope, self.nope, self.v = heads, rank, rope, nope, v
        self.q_lora, self.attend = q_lora, attend
        if q_lora:
            self.iota = nn.Linear(hidden, q_rank, bias=False)
            self.theta = Scaler(q_rank)
            self.sigma = nn.Linear(q_rank, heads * (nope + rope), bias=False)
        else:
            self.psi = nn.Linear(hidden, heads * (nope + rope), bias=False)
        self.rho = nn.Linear(hidden, rank + rope, bias=False)
        self.tau = Scaler(rank)
        self.phi = nn.Linear(rank, heads * (nope + v), bias=False)
        self.chi = nn.Linear(heads * v, hidden, bias=False)
        self.scale = (nope + rope) ** -0.5

    def assemble(self, q_nope, q_rot, k_nope, k_rot):
        """Query and key from their no-position and rotary parts."""
        return torch.cat([q_nope, q_rot], dim=-1), torch.cat([k_nope, k_rot.expand(-1, self.heads, -1, -1)], dim=-1)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None):
        b, s, _ = hidden_states.shape
        q = self.sigma(self.theta(self.iota(hidden_states))) if self.q_lora else self.psi(hidden_states)
        q = q.view(b, s, self.heads, -1).transpose(1, 2)
        lat, rot = self.rho(hidden_states).split([self.rank, self.rope], dim=-1)
        kv = self.phi(self.tau(lat)).view(b, s, self.heads, -1).transpose(1, 2)
        k_nope, value = kv.split([self.nope, self.v], dim=-1)
        if self.rope:
            q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
            cos, sin = position_embeddings
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            query, key = self.assemble(q_nope, rotate(q_rot, cos, sin), k_nope, rotate(rot.view(b, 1, s, -1), cos, sin))
        else:
            query, key = q, k_nope
        if self.attend == "sdpa":
            out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                             is_causal=attention_mask is None, scale=self.scale)
        else:
            scores = torch.matmul(query, key.transpose(2, 3)) * self.scale
            if attention_mask is None:
                attention_mask = torch.full((s, s), float("-inf")).triu(1)
            probs = nn.functional.softmax(scores + attention_mask, dim=-1, dtype=torch.float32).to(query.dtype)
            out = torch.matmul(probs, value)
        return self.chi(out.transpose(1, 2).reshape(b, s, -1))


class FilledRipple(Ripple):
    """Ripple building query and key as remote DeepSeek code does: item writes into ``new_empty`` buffers."""

    def assemble(self, q_nope, q_rot, k_nope, k_rot):
        b, h, s, _ = q_nope.shape
        query = k_rot.new_empty(b, h, s, self.nope + self.rope)
        query[:, :, :, : self.nope] = q_nope
        query[:, :, :, self.nope:] = q_rot
        key = k_rot.new_empty(b, h, s, self.nope + self.rope)
        key[:, :, :, : self.nope] = k_nope
        key[:, :, :, self.nope:] = k_rot
        return query, key


def _attend(query, key, value, how):
    """Causal attention of ``[B, H, S, D]`` operands, computed inline ("matmul") or by SDPA."""
    if how == "sdpa":
        return nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
    s = query.shape[2]
    scores = query @ key.transpose(-1, -2) * query.shape[-1] ** -0.5 + torch.full((s, s), float("-inf")).triu(1)
    return scores.softmax(-1) @ value


class Tangle(nn.Module):
    """GQA attention computing attention itself (a/b/c = query/key/value, d = output; no norm chain), with
    ``qk_norm`` per-head RMSNorms of one width on query and key (two equal-width norms, no up-projection)."""

    def __init__(self, hidden=32, heads=4, kv_heads=2, head=8, attend="matmul", qk_norm=False):
        super().__init__()
        self.heads, self.kv_heads, self.head, self.attend, self.qk_norm = heads, kv_heads, head, attend, qk_norm
        self.a = nn.Linear(hidden, heads * head, bias=False)
        self.b = nn.Linear(hidden, kv_heads * head, bias=False)
        self.c = nn.Linear(hidden, kv_heads * head, bias=False)
        self.d = nn.Linear(heads * head, hidden, bias=False)
        if qk_norm:
            self.e, self.f = Scaler(head), Scaler(head)

    def forward(self, x):
        b, s, _ = x.shape
        q, k = self.a(x).view(b, s, -1, self.head), self.b(x).view(b, s, -1, self.head)
        if self.qk_norm:
            q, k = self.e(q), self.f(k)
        v = self.c(x).view(b, s, -1, self.head)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return self.d(_attend(q, k, v, self.attend).transpose(1, 2).reshape(b, s, -1))


class Twins(nn.Module):
    """Query and key each through an equal-width rmsnorm(linear(x)) chain and an up-projection, the value through a
    plain projection: two chains like MLA's q-LoRA, no KV chain (the key's up-projection does not carry values)."""

    def __init__(self, hidden=32, heads=2, rank=12, head=8, attend="matmul"):
        super().__init__()
        self.heads, self.head, self.attend = heads, head, attend
        self.m, self.mn, self.mu = nn.Linear(hidden, rank, bias=False), Scaler(rank), nn.Linear(rank, heads * head)
        self.k, self.kn, self.ku = nn.Linear(hidden, rank, bias=False), Scaler(rank), nn.Linear(rank, heads * head)
        self.v = nn.Linear(hidden, heads * head, bias=False)
        self.o = nn.Linear(heads * head, hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.mu(self.mn(self.m(x))), self.ku(self.kn(self.k(x))), self.v(x)
        q, k, v = (t.view(b, s, self.heads, self.head).transpose(1, 2) for t in (q, k, v))
        return self.o(_attend(q, k, v, self.attend).transpose(1, 2).reshape(b, s, -1))


class RotaryNorm(nn.Module):
    """MLA-like, but the only norm sits on the rotary part of the down-projection (none on the latent)."""

    def __init__(self, hidden=32, heads=2, rank=16, rope=4, nope=8, v=6, attend="matmul"):
        super().__init__()
        self.heads, self.rank, self.rope, self.nope, self.v, self.attend = heads, rank, rope, nope, v, attend
        self.q = nn.Linear(hidden, heads * (nope + rope), bias=False)
        self.down = nn.Linear(hidden, rank + rope, bias=False)
        self.rn = Scaler(rope)
        self.up = nn.Linear(rank, heads * (nope + v), bias=False)
        self.out = nn.Linear(heads * v, hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        lat, rot = self.down(x).split([self.rank, self.rope], dim=-1)
        k_nope, v = self.up(lat).view(b, s, self.heads, -1).transpose(1, 2).split([self.nope, self.v], dim=-1)
        rot = self.rn(rot).view(b, 1, s, -1).expand(-1, self.heads, -1, -1)
        return self.out(_attend(q, torch.cat([k_nope, rot], -1), v, self.attend).transpose(1, 2).reshape(b, s, -1))


class Churn(nn.Module):
    """A Mamba-like mixer (Jamba's layout under other names): in-projection, depthwise conv, x-projection whose
    dt/B/C parts go through RMSNorms, dt-projection, a toy selective scan, out-projection."""

    def __init__(self, hidden=32, inner=64, state=8, dt_rank=4, conv=4):
        super().__init__()
        self.inner, self.state, self.dt_rank = inner, state, dt_rank
        self.lift = nn.Linear(hidden, 2 * inner, bias=False)
        self.mix = nn.Conv1d(inner, inner, conv, groups=inner, padding=conv - 1)
        self.pick = nn.Linear(inner, dt_rank + 2 * state, bias=False)
        self.step = nn.Linear(dt_rank, inner)
        self.n_dt, self.n_b, self.n_c = Scaler(dt_rank), Scaler(state), Scaler(state)
        self.drop = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        s = x.shape[1]
        u, gate = self.lift(x).chunk(2, dim=-1)
        u = nn.functional.silu(self.mix(u.transpose(1, 2))[..., :s].transpose(1, 2))
        dt, bb, cc = self.pick(u).split([self.dt_rank, self.state, self.state], dim=-1)
        dt = nn.functional.softplus(self.step(self.n_dt(dt)))
        h = torch.cumsum((dt * u).unsqueeze(-1) * self.n_b(bb).unsqueeze(-2), dim=1)
        y = (h * self.n_c(cc).unsqueeze(-2)).sum(-1)
        return self.drop(y * nn.functional.silu(gate))


class TinyLM(nn.Module):
    """A two-layer 'model' of Ripple layers for ``fuse``: embeddings, rotary tables, residual layers, a head."""

    def __init__(self, vocab=40, hidden=32, rope=4, layers=2, **ripple):
        super().__init__()
        self.config = toy_config("sdpa")
        self.rope = rope
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Ripple(hidden=hidden, rope=rope, config=self.config, **ripple)
                                    for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def set_attn_implementation(self, name):
        self.config._attn_implementation = name

    def forward(self, input_ids, use_cache=False):
        h = self.embed(input_ids)
        rope = toy_rope(*input_ids.shape, self.rope)
        for layer in self.layers:
            h = h + layer(h, rope)
        return self.head(h)
