"""MoE fuser: structural matching on toy blocks with arbitrary names, declines, and fused == native on tiny
DeepSeek-V2/V3, Mixtral, Qwen3-MoE and Qwen2-MoE models (plus the Triton kernels under the interpreter)."""

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation

import mla_fuser
from mla_fuser.fusers.base import Fuser
from mla_fuser.fusers.moe import IMPL_NAME, MoEFuser, StackedExperts, route
from mla_fuser.plans import plan_of

from conftest import swap_experts_like_on_a_gpu, tiny_deepseek

H, E, I, K = 32, 4, 16, 2
WIDE = 48


@pytest.fixture(autouse=True)
def _fresh_cache():
    Fuser.cache_clear()
    yield


def _cfg():
    cfg = PretrainedConfig()
    cfg._experts_implementation = "eager"
    return cfg


# ---------------------------------------------------------------- toy parts (names deliberately unusual)

@use_experts_implementation
class Bank(nn.Module):
    """Decorated experts: the names ``gate_up_proj``/``down_proj``/``num_experts`` are the experts contract."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * 0.2)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            gate, up = F.linear(hidden_states[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def flagged_bank(**flags):
    """Decorated experts with the decorator's layout flags (transposed weights, biases, ...)."""

    @use_experts_implementation(**flags)
    class FlagBank(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            transposed = flags.get("is_transposed", False)
            self.gate_up_proj = nn.Parameter(torch.randn(*((E, H, 2 * I) if transposed else (E, 2 * I, H))) * 0.2)
            self.down_proj = nn.Parameter(torch.randn(*((E, I, H) if transposed else (E, H, I))) * 0.2)
            if flags.get("has_bias"):
                self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * I) * 0.1)
                self.down_proj_bias = nn.Parameter(torch.randn(E, H) * 0.1)
            self.act_fn = nn.GELU(approximate="tanh")

        def forward(self, hidden_states, top_k_index, top_k_weights):  # only the interface implementations run
            raise NotImplementedError

    return FlagBank(_cfg())


class Knot(nn.Module):
    """A gated MLP with odd names: ``omega(act(alpha(x)) * beta(x))``."""

    def __init__(self, width=I):
        super().__init__()
        self.alpha, self.beta, self.omega = nn.Linear(H, width, bias=False), nn.Linear(H, width, bias=False), \
            nn.Linear(width, H, bias=False)

    def forward(self, x):
        return self.omega(F.silu(self.alpha(x)) * self.beta(x))


class Pipe(nn.Module):
    """A plain (non-GLU) MLP: ``out(gelu(inn(x)))``."""

    def __init__(self):
        super().__init__()
        self.inn, self.out, self.bend = nn.Linear(H, 24), nn.Linear(24, H), nn.GELU()

    def forward(self, x):
        return self.out(self.bend(self.inn(x)))


class Chooser(nn.Module):
    """Routers of several kinds behind one class; ``mode`` picks the computation (traced, never read by name)."""

    def __init__(self, mode="renorm", scale=1.0, fp32=False, groups=None):
        super().__init__()
        self.mode, self.scale, self.fp32, self.groups = mode, scale, fp32, groups
        self.table = nn.Parameter(torch.randn(E, H) * 0.3)
        if mode == "sigmoid_bias":
            self.offset = nn.Buffer(torch.randn(E) * 0.1)
        if mode == "learned_bias":
            self.nudge = nn.Parameter(torch.randn(E) * 0.1)

    def forward(self, x):
        x = x.reshape(-1, H)
        if self.fp32:
            logits = F.linear(x.float(), self.table.float())
        elif self.mode == "learned_bias":
            logits = F.linear(x, self.table) + self.nudge  # not a known step: must decline
        else:
            logits = F.linear(x, self.table)
        if self.mode == "sigmoid_bias":
            probs = logits.sigmoid()
            pick = probs + self.offset
            grouped = pick.view(-1, self.groups, E // self.groups).topk(2, dim=-1)[0].sum(dim=-1)
            chosen = torch.topk(grouped, k=1, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(grouped)
            mask.scatter_(1, chosen, 1)
            mask = mask.unsqueeze(-1).expand(-1, self.groups, E // self.groups).reshape(-1, E)
            ids = torch.topk(pick.masked_fill(~mask.bool(), float("-inf")), k=K, dim=-1, sorted=False)[1]
            w = probs.gather(1, ids)
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
            return w * self.scale, ids
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        if self.mode == "groups":
            best = probs.view(-1, self.groups, E // self.groups).max(dim=-1).values
            chosen = torch.topk(best, k=1, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(best)
            mask.scatter_(1, chosen, 1)
            mask = mask.unsqueeze(-1).expand(-1, self.groups, E // self.groups).reshape(-1, E)
            probs = probs.masked_fill(~mask.bool(), 0.0)
        if self.mode == "prior":
            ids = torch.topk(torch.arange(E, dtype=probs.dtype).expand_as(probs), K, dim=-1)[1]  # ignores the scores
            return probs.gather(1, ids), ids
        w, ids = torch.topk(probs, K, dim=-1)
        if self.mode == "renorm":
            w = w / w.sum(dim=-1, keepdim=True)
        return w * self.scale, ids


class Block(nn.Module):
    """Toy MoE block: ``chooser`` -> ``bank``, optional shared ``common`` (optionally gated by ``valve``)."""

    def __init__(self, router=None, shared=None, gated=False, tail="plain", bank=None):
        super().__init__()
        self.chooser = router or Chooser()
        self.bank = bank or Bank(_cfg())
        self.common = shared
        self.valve = nn.Linear(H, 1, bias=False) if gated else None
        self.tail = tail
        if tail == "buffer":
            self.squash = nn.Buffer(torch.full((H,), 0.5))
        if tail == "pre_linear":
            self.pre = nn.Linear(H, H, bias=False)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        routed_in = x
        if self.tail == "buffer":
            routed_in = x * self.squash
        elif self.tail == "pre_linear":
            routed_in = self.pre(x)
        w, ids = self.chooser(routed_in)
        out = self.bank(x, ids, w).view(b, s, h)
        if self.common is not None:
            extra = self.common(hidden_states)
            if self.valve is not None:
                extra = torch.sigmoid(self.valve(hidden_states)) * extra
            out = out + extra
        if self.tail == "tuple":
            return out, w
        return out


class Stack(nn.Module):
    """Mixtral-4.x-style block: a linear router and a dispatch loop over a ModuleList of gated MLPs."""

    def __init__(self, shared=False):
        super().__init__()
        self.lever = nn.Linear(H, E, bias=False)
        self.crew = nn.ModuleList(Knot(WIDE) for _ in range(E))  # intermediate wider than hidden, as Mixtral
        self.aside = Knot(24) if shared else None

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        probs = F.softmax(self.lever(x), dim=1, dtype=torch.float)
        w, ids = torch.topk(probs, K, dim=-1)
        w /= w.sum(dim=-1, keepdim=True)
        w = w.to(x.dtype)
        out = torch.zeros((b * s, h), dtype=x.dtype, device=x.device)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        for e in range(E):
            pos, tok = torch.where(mask[e])
            y = self.crew[e](x[None, tok].reshape(-1, h)) * w[tok, pos, None]
            out.index_add_(0, tok, y.to(x.dtype))
        out = out.reshape(b, s, h)
        if self.aside is not None:
            out = out + self.aside(hidden_states)
        return out


def _rel(a, b):
    return ((a - b).abs().max() / a.abs().max().clamp(min=1e-12)).item()


def _fuse_block(block):
    """Apply the fuser to one block (what ``fuse`` does per candidate) and check it is reported fused."""
    x = torch.randn(2, 5, H)
    match, reason = MoEFuser.explain(block, ((x,), {}))
    assert match is not None, reason
    row = MoEFuser.apply(block, match, "blk")
    assert row.status == "fused", row.reason
    return row


# ---------------------------------------------------------------- matcher: accepts

def test_softmax_topk_renorm():
    block = Block().eval()
    m = MoEFuser.match(block)
    assert m is not None and m.experts == "bank" and m.experts_kind == "interface"
    r = m.router
    assert (r.linear, r.linear_is_module, r.scoring, r.top_k, r.renormalize, r.scaling) == \
        ("chooser.table", False, "softmax", K, True, 1.0)
    assert r.softmax_dtype is torch.float32 and r.n_group is None and r.correction_bias is None
    assert (m.num_experts, m.hidden_size, m.intermediate_size, m.activation) == (E, H, I, "silu")
    assert not m.shared and not m.interleaved and not m.transposed and not m.has_bias


def test_scaled_router_without_renorm():
    m = MoEFuser.match(Block(Chooser(mode="plain", scale=2.5)))
    assert m.router.scaling == 2.5 and not m.router.renormalize and m.router.weights_from == "values"


def test_fp32_router_dtype_read_from_the_graph():
    block = Block(Chooser(fp32=True)).to(torch.bfloat16)
    m = MoEFuser.match(block)
    assert m.router.router_dtype is torch.float32
    assert m.router.input_dtypes == (torch.float32,) and m.router.weight_dtypes == (torch.float32,)
    plain = MoEFuser.match(Block().to(torch.bfloat16))
    assert plain.router.router_dtype is torch.bfloat16 and plain.router.input_dtypes == ()


def test_group_limited_router():
    m = MoEFuser.match(Block(Chooser(mode="groups", groups=2)))
    r = m.router
    assert (r.n_group, r.topk_group, r.group_scoring, r.group_fill) == (2, 1, "max", 0.0)


def test_sigmoid_correction_bias_router():
    block = Block(Chooser(mode="sigmoid_bias", groups=2, scale=1.5))
    r = MoEFuser.match(block).router
    assert (r.scoring, r.correction_bias, r.n_group, r.group_scoring, r.group_topn) == \
        ("sigmoid", "chooser.offset", 2, "topn_sum", 2)
    assert r.weights_from == "scores" and r.steps == (("renorm", 1e-20), ("scale", 1.5))
    x = torch.randn(9, H)  # the replay is the router's own computation, bit for bit
    w, ids = route(r, block, x)
    w0, ids0 = block.chooser(x)
    assert torch.equal(ids, ids0) and torch.equal(w, w0)


@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert(gated):
    m = MoEFuser.match(Block(shared=Knot(24), gated=gated))
    (shared,) = m.shared
    assert (shared.mlp, shared.kind, shared.gate, shared.flat) == ("common", "glu", "valve" if gated else None, False)


def test_non_glu_shared_mlp():
    (shared,) = MoEFuser.match(Block(shared=Pipe())).shared
    assert (shared.mlp, shared.kind) == ("common", "plain")


def test_module_list_experts():
    m = MoEFuser.match(Stack(shared=True))
    assert (m.experts, m.experts_kind, m.num_experts, m.activation) == ("crew", "module_list", E, "silu")
    assert (m.hidden_size, m.intermediate_size) == (H, WIDE)
    assert (m.expert_mlp.gate, m.expert_mlp.up, m.expert_mlp.down) == ("alpha", "beta", "omega")
    assert (m.router.linear, m.router.linear_is_module, m.router.renormalize) == ("lever", True, True)
    assert m.router.steps[-1] == ("cast", torch.float32)
    assert [s.mlp for s in m.shared] == ["aside"]


@pytest.mark.parametrize("flags", [dict(is_transposed=True), dict(has_bias=True),
                                   dict(is_transposed=True, has_bias=True)])
def test_registered_implementation_follows_the_layout_flags(flags):
    bank = flagged_bank(**flags)
    m = MoEFuser.match(Block(bank=bank))
    assert (m.transposed, m.has_bias, m.activation) == (flags.get("is_transposed", False),
                                                        flags.get("has_bias", False), "gelu_tanh")
    x, ids, w = torch.randn(7, H), torch.randint(0, E, (7, K)), torch.rand(7, K)
    with torch.no_grad():
        ref = ALL_EXPERTS_FUNCTIONS["batched_mm"](bank, x, ids, w)
        out = ALL_EXPERTS_FUNCTIONS[IMPL_NAME](bank, x, ids, w)
    assert _rel(ref, out) <= 1e-5


# ---------------------------------------------------------------- matcher: declines (with the reason)

@pytest.mark.parametrize("block, words", [
    (lambda: Block(Chooser(mode="learned_bias")), "unaccounted"),
    (lambda: Block(tail="tuple"), "tuple"),
    (lambda: Block(tail="pre_linear"), "pre"),
    (lambda: Block(tail="buffer"), "squash"),
    (lambda: Block(Chooser(mode="prior")), "top-k"),
    (lambda: Block(bank=flagged_bank(is_concatenated=False)), "is_concatenated"),
])
def test_declines(block, words):
    match, reason = MoEFuser.explain(block())
    assert match is None and words in reason, reason


def test_decline_stays_native_in_fuse():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = _cfg()
            self.layers = nn.ModuleList([Block(Chooser(mode="learned_bias")), Block()])

        def set_attn_implementation(self, name):
            self.config._attn_implementation = name

    holder = Holder().eval()
    report = mla_fuser.fuse(holder)
    rows = {r.qualname: r for r in report.rows if r.fuser == "moe"}
    assert rows["layers.0"].status == "fallback" and "unaccounted" in rows["layers.0"].reason
    assert rows["layers.1"].status == "fused"
    # only the fused block's experts switched implementation; the model-wide config is untouched
    assert holder.layers[1].bank.config._experts_implementation == IMPL_NAME
    assert holder.layers[0].bank.config._experts_implementation == "eager"
    assert holder.config._experts_implementation == "eager"


def test_expert_parallel_experts_are_reported_as_running_transformers_implementation():
    """Under expert parallelism each rank holds some experts, which the kernel does not take: the block still fuses
    (router, shared experts) and the report says the experts run Transformers' own implementation."""
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = _cfg()
            self.layers = nn.ModuleList([Block(), Block()])

        def set_attn_implementation(self, name):
            self.config._attn_implementation = name

    holder = Holder().eval()
    holder.layers[1].bank._is_expert_parallel = True  # (what Transformers sets on experts it shards by expert)
    rows = {r.qualname: r for r in mla_fuser.fuse(holder).rows if r.fuser == "moe"}
    assert rows["layers.1"].status == "fused" and "expert-parallel here" in rows["layers.1"].reason
    assert "expert-parallel" not in rows["layers.0"].reason


# ---------------------------------------------------------------- apply on toy blocks

@pytest.mark.parametrize("make", [
    lambda: Block(shared=Knot(24), gated=True),
    lambda: Block(Chooser(mode="sigmoid_bias", groups=2, scale=1.5), shared=Pipe()),
    lambda: Block(Chooser(mode="groups", groups=2)),
])
def test_interface_block_fused_equals_native(make, monkeypatch):
    block = make().eval()
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        ref = block(x)
        _fuse_block(block)
        calls = []
        kernel = ALL_EXPERTS_FUNCTIONS[IMPL_NAME]
        monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, IMPL_NAME,
                            lambda *a: calls.append(1) or kernel(*a))
        out = block(x)
    assert calls and _rel(ref, out) <= 1e-5
    assert "forward" not in block.__dict__  # the block forward is the original one


def test_module_list_block_fused_in_place():
    block = Stack(shared=True).eval()
    keys = set(block.state_dict())
    x = torch.randn(2, 7, H)
    with torch.no_grad():
        ref = block(x)
        _fuse_block(block)
        out = block(x)
    assert _rel(ref, out) <= 1e-5
    assert "forward" in block.__dict__ and Stack.forward is type(block).forward
    assert set(block.state_dict()) == keys
    stacked: StackedExperts = plan_of(block, "moe").stacked
    assert block.crew[2].beta.weight.data_ptr() == stacked.gate_up[2, WIDE:].data_ptr()  # views, no second copy
    assert block.crew[3].omega.weight.data_ptr() == stacked.down[3].data_ptr()
    # a dtype round trip gives new storage: re-stacked at the next call, still equal to an unfused twin
    twin = Stack(shared=True).eval()
    twin.load_state_dict(block.state_dict())
    block.to(torch.bfloat16).to(torch.float32)
    twin.to(torch.bfloat16).to(torch.float32)
    with torch.no_grad():
        assert _rel(twin(x), block(x)) <= 1e-5
    assert block.crew[0].alpha.weight.data_ptr() == plan_of(block, "moe").stacked.gate_up.data_ptr()
    # training / gradients run the original forward (the kernel has no backward)
    block.train()
    block(x).sum().backward()
    assert block.crew[0].alpha.weight.grad is not None


# ---------------------------------------------------------------- whole models

def _small(config_cls, **kw):
    from transformers import AutoModelForCausalLM

    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)
    base.update(kw)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_cls(**base), attn_implementation="sdpa").eval()


def _model(arch):
    import transformers as tf

    if arch in ("deepseek_v2", "deepseek_v3"):
        return tiny_deepseek(arch)
    if arch == "deepseek_v2_groups":
        return tiny_deepseek("deepseek_v2", topk_method="group_limited_greedy", n_group=2, topk_group=1,
                             routed_scaling_factor=2.0)
    if arch == "mixtral":
        return _small(tf.MixtralConfig, num_local_experts=4)
    if arch == "qwen3_moe":
        return _small(tf.Qwen3MoeConfig, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True)
    if arch == "qwen2_moe":
        return _small(tf.Qwen2MoeConfig, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    raise KeyError(arch)


MOE_LAYERS = {"deepseek_v2": 1, "deepseek_v2_groups": 1, "deepseek_v3": 1, "mixtral": 2, "qwen3_moe": 2,
              "qwen2_moe": 2}


@pytest.mark.parametrize("arch", list(MOE_LAYERS))
def test_fused_model_matches_native(arch):
    native, fused = _model(arch), _model(arch)
    report = mla_fuser.fuse(fused)
    moe = [r for r in report.rows if r.fuser == "moe"]
    assert len(moe) == MOE_LAYERS[arch] and all(r.status == "fused" for r in moe), str(report)
    assert fused.config._experts_implementation == native.config._experts_implementation  # model-wide untouched
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _rel(native(input_ids=ids).logits, fused(input_ids=ids).logits) <= 1e-4
    mask = torch.ones_like(ids)
    gen_a = native.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    gen_b = fused.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(gen_a, gen_b)


def test_experts_implementation_keyword_selects_the_kernel():
    from transformers import AutoModelForCausalLM

    config = _model("qwen3_moe").config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=IMPL_NAME).eval()
    assert model.config._experts_implementation == IMPL_NAME
    native = _model("qwen3_moe")
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _rel(native(input_ids=ids).logits, model(input_ids=ids).logits) <= 1e-4


def test_user_choice_after_fuse_wins():
    model = _model("mixtral")
    mla_fuser.fuse(model)
    experts = model.model.layers[0].mlp.experts
    assert experts.config._experts_implementation == IMPL_NAME
    model.set_experts_implementation("batched_mm")
    assert experts.config._experts_implementation == "batched_mm"


def test_triton_kernels_under_the_interpreter(monkeypatch):
    """``MLA_FUSER_BACKEND=triton``: the Triton kernels run (interpreted on CPU, compiled with a GPU)."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_FUSER_BACKEND", "triton")
    import mla_fuser.kernels.fused_moe as fm

    launched = []
    original = fm.fused_experts_triton
    monkeypatch.setattr(fm, "fused_experts_triton", lambda *a, **k: launched.append(1) or original(*a, **k))
    native, fused = _model("qwen2_moe").to(device), _model("qwen2_moe").to(device)
    mla_fuser.fuse(fused)
    ids = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        assert _rel(native(input_ids=ids).logits, fused(input_ids=ids).logits) <= 1e-4
    block = Stack().eval().to(device)
    x = torch.randn(1, 6, H, device=device)
    with torch.no_grad():
        ref = block(x)
        match, reason = MoEFuser.explain(block, ((x,), {}))
        assert MoEFuser.apply(block, match, "blk").status == "fused"
        assert _rel(ref, block(x)) <= 1e-4
    assert len(launched) >= 3


def test_generate_decode_swap_keeps_the_fused_experts():
    """Transformers' generate switches grouped_mm to batched_mm for its decode steps; a fused model keeps its
    kernel there (a user's own choice made before the call still wins)."""
    from mla_fuser.fusers.moe import keep_fused_experts

    model = _model("mixtral")
    mla_fuser.fuse(model)
    experts = model.model.layers[0].mlp.experts
    with keep_fused_experts(model):
        model.set_experts_implementation("batched_mm")  # what _optimize_model_for_decode does
        assert experts.config._experts_implementation == IMPL_NAME
        model.set_experts_implementation("grouped_mm")
    model.set_experts_implementation("batched_mm")  # the user's choice, outside generate
    with keep_fused_experts(model):
        assert experts.config._experts_implementation == "batched_mm"
    model.set_experts_implementation("grouped_mm")
    seen = []
    original = type(experts).forward

    def spy(self, *args, **kwargs):
        seen.append(self.config._experts_implementation)
        return original(self, *args, **kwargs)

    experts.forward = types.MethodType(spy, experts)

    swaps = swap_experts_like_on_a_gpu(model)
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    model.generate(ids, max_new_tokens=4, do_sample=False)
    assert len(seen) == 4 and set(seen) == {IMPL_NAME} and len(swaps) == 1


def test_a_fullgraph_compiled_forward_keeps_the_fused_experts_through_the_decode_swap():
    """A forward compiled with ``fullgraph=True`` inside generate's decode-time swap reads the swap's flag while
    Dynamo traces it (torch 2.11's Dynamo cannot trace ``ContextVar.get``: the compile failed there), stays on the
    fused kernel inside the block and runs batched_mm, the user's choice, outside it."""
    from mla_fuser.fusers.moe import keep_fused_experts
    import mla_fuser.kernels.fused_moe as fm

    model = _model("mixtral")
    native = _model("mixtral")
    mla_fuser.fuse(model)
    ran = []
    kernel = fm.fused_experts
    torch._dynamo.reset()
    forward = torch.compile(model.forward, fullgraph=True, backend="eager")
    ids = torch.randint(3, 128, (1, 1), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(fm, "fused_experts", lambda *a, **k: ran.append("op") or kernel(*a, **k))
        expected = native(input_ids=ids).logits
        with keep_fused_experts(model):
            model.set_experts_implementation("batched_mm")  # what _optimize_model_for_decode does on a GPU
            try:
                inside = forward(input_ids=ids).logits
            finally:
                model.set_experts_implementation("grouped_mm")
        assert ran and set(ran) == {"op"}
        del ran[:]
        model.set_experts_implementation("batched_mm")  # the user's own choice: the compiled forward follows it
        outside = forward(input_ids=ids).logits
        assert not ran
    assert _rel(expected, inside) <= 1e-4 and _rel(expected, outside) <= 1e-4


def test_cpu_calls_of_middle_size_run_grouped_mm(monkeypatch):
    """On a CPU Transformers' ``grouped_mm`` beats the fused op's torch path between a few tokens and about a thousand
    (``CPU_GROUPED_MM_TOKENS``): there a fused experts module whose model had chosen ``grouped_mm`` runs it (native's
    numbers exactly); below and above, and whenever a backend is forced, the op runs."""
    from mla_fuser.fusers.moe import experts as ex
    import mla_fuser.kernels.fused_moe as fm

    model = _model("deepseek_v2")
    mla_fuser.fuse(model)
    experts = model.model.layers[1].mlp.experts
    assert experts.config._experts_implementation == IMPL_NAME
    grouped = ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    ran = []
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, "grouped_mm",
                        lambda *a: ran.append("grouped_mm") or grouped(*a))
    kernel = fm.fused_experts
    monkeypatch.setattr(fm, "fused_experts", lambda *a, **k: ran.append("op") or kernel(*a, **k))
    gen = torch.Generator().manual_seed(5)
    small, large = ex.CPU_GROUPED_MM_TOKENS.start, ex.CPU_GROUPED_MM_TOKENS.stop
    for tokens, expected in ((1, "op"), (small - 1, "op"), (small, "grouped_mm"), (large - 1, "grouped_mm"),
                             (large, "op")):
        x = torch.randn(tokens, experts.gate_up_proj.shape[-1], generator=gen)
        ids = torch.randint(0, experts.num_experts, (tokens, 2), generator=gen)
        w = torch.rand(tokens, 2, generator=gen)
        ran.clear()
        with torch.no_grad():
            out = experts(x, ids, w)
            ref = grouped(experts, x, ids, w)
        assert ran == [expected], (tokens, ran)
        assert _rel(ref, out) <= 1e-5 and (expected == "op" or torch.equal(out, ref))
    monkeypatch.setenv("MLA_FUSER_BACKEND", "torch")
    ran.clear()
    with torch.no_grad():
        experts(x[:small], ids[:small], w[:small])
    assert ran == ["op"]
