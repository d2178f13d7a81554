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
