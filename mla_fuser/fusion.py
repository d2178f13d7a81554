"""``fuse(model)``: find fusable blocks by structure, rewrite them per instance, attach the report."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import attention_interfaces  # noqa: F401  (registers vllm_mla)
from . import compat, envs
from .fusers.base import FusionReport, FusionRow
from .fusers import GatedMLPFuser, MambaFuser, MoEFuser, NormFuser
from .fusers.mla import MLAFuser, apply_mla
from .fusers.fp8 import fuse_fp8_linears
from .graph import TRACE_LOCK, is_linear, rmsnorm_width
from .plans import model_state, plan_of
from .runtime import extend_continuous_batching, extend_generate

ATTENTION_NAME = attention_interfaces.ATTENTION_NAME
SUPPORTED_TRANSFORMERS = compat.SUPPORTED
_warned_disabled = False


def mla_disabled() -> bool:
    """``VLLM_MLA_DISABLE`` is read (never written) at each fuse (``envs``: one vocabulary for every switch)."""
    return envs.mla_disabled()


def transformers_supported() -> tuple[bool, str]:
    import transformers

    low, high = SUPPORTED_TRANSFORMERS
    return low <= compat.transformers_version() < high, transformers.__version__


def _mla_candidate(module: nn.Module) -> bool:
    """Cheap pre-filter: at least three linear children (or adapter layers around linears, e.g. PEFT LoRA: the
    fused MLA forward calls those as themselves) and one RMSNorm-by-computation child."""
    children = list(module.children())
    if sum(is_linear(c, adapters=True) for c in children) < 3:
        return False
    return any(rmsnorm_width(c) for c in children if not is_linear(c, adapters=True))


# The sibling fuser families (``fusers.base.Fuser``): each has ``name``, ``candidate_names(model)`` (by default the
# modules ``is_candidate`` accepts), ``explain(module, example_inputs) -> (match | None, reason)`` and ``apply(module,
# match, qualname) -> FusionRow``.  Order matters: each family's blocks are matched and applied before the next
# family's, so the MoE fuser reads its shared experts before the gated-MLP fuser binds their instance forwards.
BLOCK_FUSERS = (MoEFuser, MambaFuser, NormFuser, GatedMLPFuser)


class _Capture(dict):
    """Candidate name -> ``(args, kwargs)`` of its first call; ``complete`` when the forward ran to the end,
    ``error`` the reason when it did not run (or failed part way)."""

    complete = False
    error: str | None = None


def _capture_inputs(model: nn.Module, names: list[str]) -> "_Capture":
    """Run one tiny forward (3 tokens, no cache) and record each candidate's first call arguments."""
    captured = _Capture()
    if next(model.parameters(), None) is None or not hasattr(model, "get_input_embeddings"):
        captured.error = "the model has no parameters or no input embeddings"
        return captured
    embeddings = model.get_input_embeddings()
    device = embeddings.weight.device
    if device.type == "meta":
        # offloaded by accelerate (device_map with cpu/disk offload): its hook loads the weights on the
        # execution device when called; a model merely built on meta has no hook and is not run
        device = getattr(getattr(embeddings, "_hf_hook", None), "execution_device", None)
        if device is None:
            captured.error = "the model is on the meta device"
            return captured
    hooks = []
    for name in names:
        def hook(mod, args, kwargs, name=name):
            captured.setdefault(name, (args, dict(kwargs)))
        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    was_training = model.training
    try:
        vocab = embeddings.weight.shape[0]
        ids = torch.arange(1, 4, device=device).clamp(max=vocab - 1).view(1, 3)
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        captured.complete = True
    except Exception as exc:  # best effort: modules not reached are traced from their annotations instead
        captured.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return captured


def _not_called_row(name: str, module: nn.Module, fuser: str) -> FusionRow:
    return FusionRow(name, type(module).__name__, fuser, "fallback",
                     "not called by the model's forward: no real inputs to trace with")


def _switch_attention(model: nn.Module, report: FusionReport) -> bool:
    config = getattr(model, "config", None)
    if config is None:
        report.notes.append("model has no config: attention implementation left unchanged")
        return False
    if compat.attention_implementation(model) == ATTENTION_NAME:
        return True
    try:
        model.set_attn_implementation(ATTENTION_NAME)
    except Exception as exc:
        report.notes.append(f"could not switch the model to {ATTENTION_NAME}: {exc}")
        return False
    return True


def fuse(model: nn.Module) -> FusionReport:
    """Fuse ``model`` in place (idempotent) and return the report, also kept as ``model.fusion_report``.

    Thread-safe: fusions in several threads run one after the other (``graph.TRACE_LOCK``), since tracing
    patches process-wide state and the match caches are shared by the process."""
    with TRACE_LOCK:
        return _fuse(model)


def _fuse(model: nn.Module) -> FusionReport:
    global _warned_disabled
    existing = getattr(model, "fusion_report", None)
    if isinstance(existing, FusionReport) and model_state(model).fused:
        return existing
    envs.check_all()  # a bad flag (MLA_FUSER_BACKEND=cuda, VLLM_MLA_DISABLE=maybe) fails here, not at a forward
    report = FusionReport()
    ok, version = transformers_supported()
    if not ok:
        report.notes.append(
            f"transformers {version} is outside the supported range >=5.17,<6: nothing fused, standard attention"
        )
        _attach(model, report)
        return report
    if not _switch_attention(model, report):
        _attach(model, report)
        return report
    disabled = mla_disabled()
    if disabled:
        flag = envs.describe("VLLM_MLA_DISABLE")
        report.notes.append(f"{flag}: MLA fusion disabled, vllm_mla runs padded full attention")
        if not _warned_disabled:
            warnings.warn(f"{flag}: mla-fuser runs padded full attention, no MLA fusion", stacklevel=2)
            _warned_disabled = True
    # FP8 (issue 15): block-FP8 linears run on our kernels before anything runs the model (the capture below
    # calls them; Transformers' own FP8Linear forward needs a Hub download)
    report.rows.extend(fuse_fp8_linears(model))
    block_fusers = BLOCK_FUSERS
    block_names = {f: f.candidate_names(model) for f in block_fusers}
    disabled_by_version = compat.disabled_features()
    report.notes.extend(why for f, names in block_names.items() if names
                        for feature, why in disabled_by_version.items() if f.name == feature)
    claimed = set().union(*block_names.values()) if block_names else set()
    # a module another family claims (a Mamba mixer has linears and a norm too) is not an MLA candidate
    names = [n for n, m in model.named_modules() if n and n not in claimed and _mla_candidate(m)]
    wanted = sorted(set(names).union(*block_names.values()))
    captured = _capture_inputs(model, wanted) if wanted else _Capture()
    if wanted and not captured.complete:
        report.notes.append(f"input capture forward did not complete ({captured.error}); modules it did not reach "
                            "are traced from their signatures")
    for name in names:
        module = model.get_submodule(name)
        if plan_of(module, "mla") is not None:
            report.rows.append(FusionRow(name, type(module).__name__, "mla", "fused", "already fused"))
            continue
        example = captured.get(name)
        if example is None and captured.complete:
            # not called in a forward of the model (e.g. a draft head, a KV-sharing consumer): nothing to match
            report.rows.append(_not_called_row(name, module, "mla"))
            continue
        match, reason = MLAFuser.explain(module, example)
        if match is None:
            if "KV chain" in reason or "attention call" in reason or "linear" in reason:
                report.rows.append(FusionRow(name, type(module).__name__, "mla", "fallback", f"not MLA: {reason}"))
            else:
                report.rows.append(FusionRow(name, type(module).__name__, "mla", "fallback", reason))
            continue
        if disabled:
            report.rows.append(FusionRow(name, type(module).__name__, "mla", "fallback", flag))
            continue
        report.rows.append(apply_mla(module, match, name))
    for fuser, fuser_names in block_names.items():
        for name in fuser_names:
            module = model.get_submodule(name)
            example = captured.get(name)
            if example is None and captured.complete:
                report.rows.append(_not_called_row(name, module, fuser.name))
                continue
            match, reason = fuser.explain(module, example)
            if match is None:
                report.rows.append(FusionRow(name, type(module).__name__, fuser.name, "fallback", reason))
            else:
                report.rows.append(fuser.apply(module, match, name))
    if not report.fused("mla") and not disabled:
        report.notes.append("no MLA module fused: every attention call runs padded full attention")
    # generate() of a PEFT model calls its base model's: that is the instance whose generate we extend
    host = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    model_state(model).fused = model_state(host).fused = True
    report.notes.extend(extend_generate(host))
    report.notes.extend(extend_continuous_batching(host))
    _attach(model, report)
    return report


def _attach(model: nn.Module, report: FusionReport) -> None:
    object.__setattr__(model, "fusion_report", report)
