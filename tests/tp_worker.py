"""Tensor-parallel worker for ``tests/test_multi_device.py`` (run under ``torchrun --nproc-per-node 2``, gloo, CPU).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_worker.py MODELS_DIR OUT_DIR

For every case below, each rank loads the saved tiny model twice with Transformers' tensor parallelism
(``DistributedConfig(tp_size=2, ...)``: its own plan, an override ``tp_plan``, or with ``ep_size=2``): once through
``mla_fuser.AutoModelForCausalLM`` (fused, ``vllm_mla``) and once natively (``sdpa``).  It records the logits of a
left-padded batch and greedy tokens: with the fused model's automatic paged latent cache, with Transformers'
``DynamicCache`` (the contiguous absorbed path), and for an unpadded batch (its mask-free decode steps run the paged
decode kernel); also the fusion report, what the fused attention saw (the heads of each query), and the rows of
``kv_b_proj`` and the experts this rank holds.
Results go to ``OUT_DIR/<case>.rank<r>.pt``; the test compares them with a single-process run.  An exception in
a case is recorded as ``error`` and shown by the test (both ranks run the same code on the same model, so they
fail alike; a one-sided failure inside a collective would block until the test's subprocess timeout).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mla_fuser  # noqa: E402
import mla_fuser.attention_interfaces.vllm_mla as vllm_mla  # noqa: E402
from mla_fuser.plans import plan_of  # noqa: E402

# Attention sharded by head: q_b_proj / q_proj and kv_b_proj column-wise, o_proj row-wise (all-reduce).  This is
# DeepSeek-V2's own plan for attention (and DeepSeek-V3's from Transformers 5.25; before, V3's plan kept attention
# replicated), so for V3 it is also passed as an override.
ATTENTION_PLAN = {
    "model.layers.*.self_attn.q_b_proj": "colwise",
    "model.layers.*.self_attn.kv_b_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
}

# Routed experts sharded by tensor parallelism: each expert's gate/up rows column-wise, down row-wise, the block's
# partial outputs summed.  Transformers' DeepSeek plans did this up to 5.24; from 5.25 their TP plans leave the
# experts whole on every rank (experts are sharded by expert parallelism, ``ep_size``) and the styles are deprecated,
# so the case that keeps the fused MoE on TP-sharded experts passes them explicitly, where they are still registered.
EXPERTS_PLAN = {
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "model.layers.*.mlp.experts.down_proj": "rowwise",
    "model.layers.*.mlp.experts": "moe_tp_experts",
}


def _styles_registered(plan) -> bool:
    try:
        from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES
    except ImportError:
        return False
    return all(style in ALL_PARALLEL_STYLES for style in plan.values())


def _supports_ep_size() -> bool:
    import dataclasses

    from transformers.distributed import DistributedConfig

    return "ep_size" in {f.name for f in dataclasses.fields(DistributedConfig)}


# case name -> (saved model directory name, DistributedConfig keywords besides tp_size=2 (none: Transformers' own
# plan), warm).  Each case starts with an empty match cache; ``warm`` first fuses a single-process copy of the model,
# so the cached match (keyed by class and global parameter shapes, which DTensors keep) records the *global* head
# count and the fused TP attention must take the local heads from the query and its kv_b_proj shard at run time.
CASES = {
    "v2_auto": ("deepseek_v2", {}, False),  # Transformers' plan: attention by head (+ MoE experts up to 5.24)
    "v2_qproj_auto": ("deepseek_v2_qproj", {}, False),  # no q-LoRA: q_proj column-wise
    "v3_auto": ("deepseek_v3", {}, False),  # Transformers' plan: MoE experts up to 5.24, attention by head from 5.25
    "v3_attention_plan": ("deepseek_v3", {"tp_plan": ATTENTION_PLAN}, False),  # a plan sharding attention by head
    "v2_auto_global_match": ("deepseek_v2", {}, True),  # the match holds 4 heads, each rank 2
}
if _styles_registered(EXPERTS_PLAN):  # attention by head and experts column-wise, on every release
    CASES["v2_tp_experts"] = ("deepseek_v2", {"tp_plan": {**ATTENTION_PLAN, **EXPERTS_PLAN}}, False)
if _supports_ep_size():  # Transformers' TP plan plus its expert-parallel plan: each rank holds half of the experts
    CASES["v2_ep"] = ("deepseek_v2", {"ep_size": 2}, False)

NEW_TOKENS = 6


def inputs():
    """A fixed left-padded batch (pad id 0)."""
    ids = torch.tensor([[5, 9, 17, 33, 4, 60, 7, 21], [0, 0, 0, 3, 8, 9, 10, 11]])
    return ids, (ids != 0).long()


def unpadded_inputs():
    """A batch without padding: its decode steps carry no mask, so they run the paged decode kernel."""
    ids = torch.tensor([[5, 9, 17, 33, 4, 60, 7, 21], [3, 8, 9, 10, 11, 12, 40, 41]])
    return ids, torch.ones_like(ids)


def _cache_kw(model):
    from mla_fuser.compat import cache_keyword

    return cache_keyword(model)


def run_model(model):
    """Logits of the padded batch, greedy tokens with the default cache and with a DynamicCache."""
    from transformers import DynamicCache

    device = model.get_input_embeddings().weight.device  # cpu under gloo; this rank's GPU under NCCL
    ids, mask = (t.to(device) for t in inputs())
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    dynamic = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             **{_cache_kw(model): DynamicCache(config=model.config)})
    ids, mask = (t.to(device) for t in unpadded_inputs())
    unpadded = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    out = {"logits": logits, "tokens": tokens, "tokens_dynamic": dynamic, "tokens_unpadded": unpadded}
    return {k: vllm_mla.local_tensor(v).cpu() for k, v in out.items()}


def run_case(path, config_kwargs, warm):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from mla_fuser.fusers.base import Fuser

    Fuser.cache_clear()
    if warm:
        mla_fuser.AutoModelForCausalLM.from_pretrained(path)  # single process, no collectives
    result = {}
    seen = {"query_heads": set(), "decode_heads": set(), "paged_decode": 0}
    original_fused, original_decode = vllm_mla.fused_mla_attention, vllm_mla.paged_decode

    def spy_fused(module, query, *args, **kwargs):
        seen["query_heads"].add(int(query.shape[1]))
        return original_fused(module, query, *args, **kwargs)

    def spy_decode(query, view, scaling, w_uk, w_uv, b_v, m, starts=None):
        seen["paged_decode"] += 1
        seen["decode_heads"].add((int(query.shape[1]), int(w_uk.shape[0]), int(w_uv.shape[0])))
        return original_decode(query, view, scaling, w_uk, w_uv, b_v, m, starts)

    config = DistributedConfig(tp_size=2, **config_kwargs)
    fused = mla_fuser.AutoModelForCausalLM.from_pretrained(path, distributed_config=config).eval()
    result["report"] = [(r.qualname, r.fuser, r.status, r.reason) for r in fused.fusion_report.rows]
    attn = fused.model.layers[0].self_attn
    kv_b = attn.kv_b_proj.weight
    result["kv_b_dtensor"] = type(kv_b).__name__ == "DTensor"
    result["kv_b_local_rows"] = int(vllm_mla.local_tensor(kv_b).shape[0])
    result["fused_attention"] = [n for n, m in fused.named_modules() if plan_of(m, "mla") is not None]
    experts = next(m for m in fused.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor))
    result["experts"] = (type(experts.gate_up_proj).__name__, tuple(experts.gate_up_proj.shape),
                         tuple(vllm_mla.local_tensor(experts.gate_up_proj).shape))
    result["n_experts"] = int(fused.config.n_routed_experts)
    result["experts_ep"] = bool(getattr(experts, "_is_expert_parallel", False))  # set by Transformers' EP plan
    vllm_mla.fused_mla_attention, vllm_mla.paged_decode = spy_fused, spy_decode
    try:
        result["fused"] = run_model(fused)
    finally:
        vllm_mla.fused_mla_attention, vllm_mla.paged_decode = original_fused, original_decode
    result["seen"] = {k: sorted(v) if isinstance(v, set) else v for k, v in seen.items()}
    native = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", distributed_config=config).eval()
    result["native"] = run_model(native)
    return result


def main():
    models_dir, out_dir = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    for name, (model_dir, config_kwargs, warm) in CASES.items():
        try:
            result = run_case(os.path.join(models_dir, model_dir), config_kwargs, warm)
        except Exception:  # recorded for the test; the other rank fails the same way (same code, same model)
            result = {"error": traceback.format_exc()}
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        torch.save(result, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
