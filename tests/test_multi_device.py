"""Fused models inside accelerate's big-model ``device_map`` and Transformers' tensor parallelism (CPU).

* ``device_map``: layers on ``cpu`` and offloaded to ``disk`` / cpu (accelerate hooks load each module's weights
  when it is called, ``meta`` in between): fused MLA / MoE modules keep their hooks, read offloaded weights through
  them, keep no stacked copy of offloaded weights, the paged latent cache lives on each layer's device, and the
  split model generates the tokens of the model on one device.  A real split over two GPUs runs only where two
  are visible (``test_two_gpus_split_equals_one_device``).
* tensor parallelism: ``torchrun --nproc-per-node 2`` with gloo (``tests/tp_worker.py``) loads the model with
  Transformers' plan (and override plans: DeepSeek-V3's attention by head, experts sharded by TP; and, where
  ``ep_size`` exists, expert parallelism); logits and greedy tokens of the fused TP model equal a single-process
  run, the fused attention works on the local heads only, and each rank holds the experts its plan gives it.  What
  a plan shards is read off the plans themselves (Transformers 5.25 moved DeepSeek's experts out of the TP plan and
  put V3's attention in it).  On a machine with two GPUs, ``MLA_FUSER_TP_GPU=1`` runs the same worker with NCCL.
"""

import contextlib
import inspect
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM

import mla_fuser
from mla_fuser.cache import PagedLatentCache, PagedLatentLayer
from mla_fuser.rewrite import STACKED_ATTR

from conftest import needs_mamba_fusion, tiny_deepseek
from tp_worker import CASES, NEW_TOKENS, inputs, unpadded_inputs

HERE = os.path.dirname(os.path.abspath(__file__))
ARCHS = ["deepseek_v2", "deepseek_v3"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny DeepSeek-V2 (q-LoRA and q_proj-only) and V3 checkpoints, seeded, fp32; plus single-process outputs."""
    root = tmp_path_factory.mktemp("models")
    models = {
        "deepseek_v2": tiny_deepseek("deepseek_v2"),
        "deepseek_v2_qproj": tiny_deepseek("deepseek_v2", q_lora_rank=None),
        "deepseek_v3": tiny_deepseek("deepseek_v3"),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
    return root


def _reference(path):
    """Single-process, single-device native model: logits of the padded batch and greedy tokens."""
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    ids, mask = inputs()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    ids, mask = unpadded_inputs()
    unpadded = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    return {"logits": logits, "tokens": tokens, "tokens_unpadded": unpadded}


def _assert_logits_close(got, ref, what):
    _, mask = inputs()
    keep = mask.bool()  # padded query positions are not compared (their rows are fully masked)
    a, b = got[keep].float(), ref[keep].float()
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err <= 1e-4, f"{what}: relative logit error {err:.2e}"


def _offload_map(layers=2, disk=(1,)):
    """A ``device_map`` for the tiny model: the decoder layers in ``disk`` are offloaded to disk, everything else
    is on ``cpu``.  (With no GPU, ``cpu`` is the execution device, so "offloaded to cpu" cannot be expressed by
    the map; ``test_fuse_then_cpu_offload`` covers cpu offload with ``accelerate.cpu_offload``.)"""
    dm = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    for i in range(layers):
        dm[f"model.layers.{i}"] = "disk" if i in disk else "cpu"
    return dm


def _cache_kw(model):
    from mla_fuser.compat import cache_keyword

    return cache_keyword(model)


def _fused_forward_is_wrapped_by_hook(module) -> bool:
    """The accelerate hook still runs around the fused forward (it was not overwritten by the rewrite)."""
    old = module.__dict__.get("_old_forward")
    return (getattr(module, "_hf_hook", None) is not None and old is not None
            and getattr(old, "__self__", None) is module
            and _is_fused_function(old.__func__))


def _is_fused_function(fn) -> bool:
    return inspect.unwrap(fn).__code__.co_filename.startswith("<mla_fuser rewritten")


# ---------------------------------------------------------------------------------------------------------
# device_map (accelerate big-model dispatch), CPU + disk offload


@pytest.mark.parametrize("arch", ARCHS)
def test_disk_offload_generates_like_one_device(saved, tmp_path, arch):
    path = saved / arch
    ref = _reference(path)
    model = mla_fuser.AutoModelForCausalLM.from_pretrained(path, device_map=_offload_map(), offload_folder=tmp_path)
    model.eval()
    report = model.fusion_report
    assert len(report.fused("mla")) == 2, str(report)
    assert len(report.fused("moe")) == 1, str(report)  # the MoE layer is the offloaded one
    offloaded = model.model.layers[1].self_attn
    assert offloaded.kv_b_proj.weight.device.type == "meta"  # really offloaded
    assert _fused_forward_is_wrapped_by_hook(offloaded)
    assert _fused_forward_is_wrapped_by_hook(model.model.layers[0].self_attn)

    ids, mask = inputs()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    _assert_logits_close(logits, ref["logits"], "fused, layer 1 on disk")

    seen = []
    original = PagedLatentLayer.update

    def spy(self, key_states, value_states, *a, **k):
        seen.append((self.layer_idx, key_states.device))
        return original(self, key_states, value_states, *a, **k)

    PagedLatentLayer.update = spy
    try:
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    finally:
        PagedLatentLayer.update = original
    assert torch.equal(tokens, ref["tokens"])
    assert {i for i, _ in seen} == {0, 1}, "generate did not use the paged latent cache"
    # offloaded weights went back to meta, and no stacked copy of them is kept alive
    assert offloaded.q_a_proj.weight.device.type == "meta" and offloaded.kv_b_proj.weight.device.type == "meta"
    assert getattr(offloaded, STACKED_ATTR).weight is None
    # the resident layer still runs the stacked down-projection, sharing storage with the originals
    resident = model.model.layers[0].self_attn
    stacked = getattr(resident, STACKED_ATTR)
    assert stacked.weight is not None and stacked.weight.data_ptr() == resident.q_a_proj.weight.data_ptr()


def test_paged_pages_live_on_each_layers_device(saved, tmp_path):
    model = mla_fuser.AutoModelForCausalLM.from_pretrained(saved / "deepseek_v2", device_map=_offload_map(),
                                                           offload_folder=tmp_path).eval()
    ref = _reference(saved / "deepseek_v2")
    ids, mask = inputs()
    cache = PagedLatentCache(model, page_size=4, max_cache_tokens=64)
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                            **{_cache_kw(model): cache})
    assert torch.equal(tokens, ref["tokens"])
    for idx in (0, 1):
        attn = model.model.layers[idx].self_attn
        hook = attn._hf_hook
        device = torch.device(hook.execution_device) if hook.execution_device is not None else torch.device("cpu")
        assert cache.pools[idx].pages.device == device
        assert cache.layers[idx].block_table.device == device and cache.layers[idx].seq_lens.device == device


@pytest.mark.parametrize("arch", ARCHS)
def test_fuse_then_cpu_offload(arch):
    """Hooks added after fusion (``accelerate.cpu_offload``: every weight offloaded, loaded per module call)."""
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_submodules

    native = tiny_deepseek(arch)
    fused = tiny_deepseek(arch, attn="vllm_mla")
    mla_fuser.fuse(fused)
    cpu_offload(fused, execution_device=torch.device("cpu"))
    attn = fused.model.layers[0].self_attn
    assert attn.kv_b_proj.weight.device.type == "meta"
    ids, mask = inputs()
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(fused.generate(ids, **kw), native.generate(ids, **kw))
    with torch.no_grad():
        _assert_logits_close(fused(input_ids=ids, attention_mask=mask).logits,
                             native(input_ids=ids, attention_mask=mask).logits, "fused + cpu_offload")
    remove_hook_from_submodules(fused)  # the fused forward comes back, not the class's
    assert _is_fused_function(attn.forward.__func__)


@needs_mamba_fusion
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_mamba_disk_offload_generates_like_one_device(tmp_path, arch):
    from tiny_mamba_configs import make_model

    make_model(arch).save_pretrained(tmp_path / "model")
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    dm = {"backbone.embeddings": "cpu", "backbone.layers.0": "cpu", "backbone.layers.1": "disk",
          "backbone.norm_f": "cpu", "lm_head": "cpu"}
    fused = mla_fuser.AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=dm,
                                                           offload_folder=tmp_path / "offload").eval()
    assert len(fused.fusion_report.fused("mamba")) == 2, str(fused.fusion_report)
    ids, mask = inputs()
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(fused.generate(ids, **kw), native.generate(ids, **kw))


def test_offloaded_embeddings_still_fuse(saved, tmp_path):
    dm = _offload_map(disk=(0,))
    dm["model.embed_tokens"] = "disk"
    model = mla_fuser.AutoModelForCausalLM.from_pretrained(saved / "deepseek_v3", device_map=dm,
                                                           offload_folder=tmp_path).eval()
    assert len(model.fusion_report.fused("mla")) == 2, str(model.fusion_report)


def test_stacked_down_projection_defers_to_offloaded_linears():
    """Offloaded down-projections are called as themselves (their hooks load the weights) and no stacked copy
    of them is kept; resident ones run as one GEMM."""
    from accelerate import cpu_offload

    from mla_fuser.rewrite import StackedLinear

    pair = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 6), "b": torch.nn.Linear(8, 5)})
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = pair["a"](x), pair["b"](x)
    stacked = StackedLinear(pair["a"], pair["b"])
    calls = []
    for lin in pair.values():
        lin.register_forward_hook(lambda mod, i, o: calls.append(mod))
    with torch.no_grad():
        got = stacked(x)
    assert not calls and all(torch.allclose(g, w) for g, w in zip(got, want))  # one stacked GEMM
    cpu_offload(pair, execution_device=torch.device("cpu"))
    assert pair["a"].weight.device.type == "meta"
    with torch.no_grad():
        got = stacked(x)
    assert calls == [pair["a"], pair["b"]]  # their hooks loaded the weights
    assert all(torch.allclose(g, w) for g, w in zip(got, want))
    assert stacked.weight is None and pair["a"].weight.device.type == "meta"


# ---------------------------------------------------------------------------------------------------------
# a real split over two devices (GPU machines only)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("arch", ARCHS)
def test_two_gpus_split_equals_one_device(saved, arch):
    path = saved / arch
    dm = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
          "model.norm": 1, "lm_head": 1}
    one = mla_fuser.AutoModelForCausalLM.from_pretrained(path, device_map={"": 0}).eval()
    split = mla_fuser.AutoModelForCausalLM.from_pretrained(path, device_map=dm).eval()
    assert len(split.fusion_report.fused("mla")) == 2
    ids, mask = inputs()
    ids, mask = ids.cuda(0), mask.cuda(0)
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    cache = PagedLatentCache(split, max_cache_tokens=256)
    assert torch.equal(split.generate(ids, **kw, **{_cache_kw(split): cache}).cpu(), one.generate(ids, **kw).cpu())
    assert cache.pools[0].pages.device == torch.device("cuda", 0)
    assert cache.pools[1].pages.device == torch.device("cuda", 1)
    with torch.no_grad():
        _assert_logits_close(split(input_ids=ids, attention_mask=mask).logits.cpu(),
                             one(input_ids=ids, attention_mask=mask).logits.cpu(), "split over 2 GPUs")


# ---------------------------------------------------------------------------------------------------------
# tensor parallelism: torchrun --nproc-per-node 2, gloo


@contextlib.contextmanager
def _one_torchrun_at_a_time():
    """A lock that other test sessions on this machine take too (CI runs both Transformers ends at once): their
    ``torchrun`` runs, each finding free ports for its store and its gloo pairs, never overlap."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX system
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), "mla_fuser_tests_torchrun.lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _distributed_available() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


@pytest.fixture(scope="module")
def tp_results(saved, tmp_path_factory):
    if not _distributed_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("tp")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    if os.environ.get("MLA_FUSER_TP_GPU") != "1":  # CPU + gloo; MLA_FUSER_TP_GPU=1 runs on two GPUs with NCCL
        env.update(CUDA_VISIBLE_DEVICES="", MLA_FUSER_BACKEND="torch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(HERE, "tp_worker.py"), str(saved), str(out)]
    with _one_torchrun_at_a_time():
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    results = {}
    for name in CASES:
        ranks = []
        for rank in (0, 1):
            f = out / f"{name}.rank{rank}.pt"
            ranks.append(torch.load(f, weights_only=False) if f.exists() else None)
        results[name] = ranks
    missing = [f"{name}.rank{rank}" for name, ranks in results.items() for rank, r in enumerate(ranks) if r is None]
    if proc.returncode != 0 or missing:  # (the missing results say how far the workers got)
        pytest.fail(f"torchrun failed ({proc.returncode}), results missing: {missing or 'none'}:\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    references = {d: _reference(saved / d) for d in {case[0] for case in CASES.values()}}
    return results, references


def _case(tp_results, name):
    results, references = tp_results
    ranks = results[name]
    for rank, r in enumerate(ranks):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return ranks, references[CASES[name][0]]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_tp_native_equals_single_process(tp_results, name):
    """The harness itself: Transformers' own TP run equals the single-process run."""
    ranks, ref = _case(tp_results, name)
    for r in ranks:
        _assert_logits_close(r["native"]["logits"], ref["logits"], f"{name} native TP")
        assert torch.equal(r["native"]["tokens"], ref["tokens"])
        assert torch.equal(r["native"]["tokens_unpadded"], ref["tokens_unpadded"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_tp_fused_equals_single_process(tp_results, name):
    ranks, ref = _case(tp_results, name)
    for rank, r in enumerate(ranks):
        _assert_logits_close(r["fused"]["logits"], ref["logits"], f"{name} fused TP rank {rank}")
        assert torch.equal(r["fused"]["tokens"], ref["tokens"]), f"{name} rank {rank}: paged cache"
        assert torch.equal(r["fused"]["tokens_dynamic"], ref["tokens"]), f"{name} rank {rank}: DynamicCache"
        assert torch.equal(r["fused"]["tokens_unpadded"], ref["tokens_unpadded"]), f"{name} rank {rank}: unpadded"
        assert len([row for row in r["report"] if row[1] == "moe" and row[2] == "fused"]) == 1, r["report"]
        _assert_experts_layout(name, r)


def _auto_plan(model_dir):
    """Transformers' own TP plan for the saved model (the config class's ``base_model_tp_plan``)."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    config_cls = DeepseekV3Config if model_dir == "deepseek_v3" else DeepseekV2Config
    return config_cls.base_model_tp_plan or {}


def _shards(plan, module) -> bool:
    return any(key.endswith(module) for key in plan)


def _expected_sharding(name, module):
    """Whether the case's plan shards ``module``: True, False, or None where the release decides (an override plan
    replaces Transformers' own in 5.17 and is merged into it later)."""
    model_dir, kwargs, _ = CASES[name]
    override, auto = kwargs.get("tp_plan"), _shards(_auto_plan(model_dir), module)
    if override is None:
        return auto
    return True if _shards(override, module) else (None if auto else False)


def _assert_experts_layout(name, r):
    """Each rank holds what the plan says: TP-sharded experts (each expert's gate/up rows halved), half of the
    experts (expert parallelism), or all of them whole.  (Up to 5.24 Transformers' DeepSeek TP plans sharded the
    experts; from 5.25 only ``ep_size`` does: which one applies is read off the plans, not the release.)"""
    kind, full, local = r["experts"]
    if CASES[name][1].get("ep_size", 1) > 1:
        assert r["experts_ep"] and local[0] * 2 == r["n_experts"], (r["experts"], r["n_experts"])
        return
    assert not r["experts_ep"], r["experts"]
    tp = _expected_sharding(name, "mlp.experts.gate_up_proj")
    if tp is None:
        tp = kind == "DTensor"
    if tp:
        assert kind == "DTensor" and local[1] * 2 == full[1] and local[0] == full[0], r["experts"]
    else:
        assert kind != "DTensor" and local == full and full[0] == r["n_experts"], r["experts"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_tp_mla_fused_on_local_heads(tp_results, name):
    ranks, _ = _case(tp_results, name)
    heads = 4
    sharded = _expected_sharding(name, "self_attn.kv_b_proj")
    assert sharded is not None  # (every case's override plan shards attention by head, or has none)
    local = heads // 2 if sharded else heads
    per_head = 8 + 8  # qk_nope_head_dim + v_head_dim of the tiny model
    for rank, r in enumerate(ranks):
        mla_rows = [row for row in r["report"] if row[1] == "mla"]
        assert len(mla_rows) == 2 and all(row[2] == "fused" for row in mla_rows), mla_rows
        assert r["kv_b_dtensor"] == sharded
        assert r["kv_b_local_rows"] == local * per_head
        assert r["seen"]["query_heads"] == [local]
        assert r["seen"]["paged_decode"] > 0
        assert r["seen"]["decode_heads"] == [(local, local, local)]
