"""``MambaFuser``: the match (pre-filter, trace, analysis, probe) and ``apply``, which binds the fused forward.

``_match`` traces the mixer (``trace.py``), reads its roles (``analysis.py``) and finally runs the fused forward
with the torch reference ops (``forward.py``) once against the original forward on a small random, left-padded
input; a mismatch declines.  ``apply`` binds ``forward.fused_forward`` to that one instance (the class and
transformers' module functions are never touched; under an accelerate hook the hooked ``_old_forward`` is
replaced instead), recording a ``MambaPlan`` through ``plans``.  It declines (a fallback row) when the mixer
has no integer ``layer_idx`` or the installed transformers' Cache lacks the Mamba state API.

The top of the package: it imports every other module, none imports it.
"""

from __future__ import annotations


import torch
from torch import nn

from ... import compat
from ... import graph as g
from ...plans import plan_of, set_plan
from ..base import Fuser, FusionRow, NoMatch, bind_instance_forward
from .analysis import Analysis
from .forward import REFERENCE, fused_forward, mixer_forward
from .specs import MambaMatch, MambaPlan
from .trace import (
    PROBE_LEN,
    depthwise_conv,
    forward_signature,
    hidden_size_candidates,
    inference_mode_flag,
    projection_weight,
    trace_mixer,
)


class MambaFuser(Fuser):
    name = "mamba"

    @staticmethod
    def is_candidate(module: nn.Module) -> bool:
        """Cheap pre-filter: a depthwise ``nn.Conv1d`` child, two linear children and a parameter of its own."""
        children = list(module.children())
        return (
            any(depthwise_conv(c) for c in children)
            and sum(isinstance(c, nn.Linear) for c in children) >= 2
            and any(True for _ in module.parameters(recurse=False))
        )

    @classmethod
    def _match(cls, module: nn.Module, example_inputs=None) -> MambaMatch:
        if not cls.is_candidate(module):
            raise NoMatch("no depthwise Conv1d child with linear projections and parameters of its own")
        signature = forward_signature(module)
        params = [p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        cache_args = [p.name for p in params[1:] if g.is_cache_annotation(p.annotation)]
        if len(cache_args) != 1:
            raise NoMatch(f"expected one Cache argument in the forward, found {len(cache_args)}")
        tensor_args = [p.name for p in params[1:] if p.name not in cache_args and g.is_tensor_annotation(p.annotation)]
        if len(tensor_args) > 1:
            raise NoMatch(f"more than one tensor argument besides the hidden states: {tensor_args}")
        mask_arg = tensor_args[0] if tensor_args else None
        traced = None
        for width in hidden_size_candidates(module, example_inputs):
            try:
                with inference_mode_flag(module):
                    traced = trace_mixer(module, params, width, mask_arg)
            except g.TraceError:
                continue
            out = g.meta_val(traced.output.args[0]) if traced.output.args else None
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (2, PROBE_LEN, width):
                break
            traced = None
        if traced is None:
            raise NoMatch("the forward does not trace to a [batch, seq, hidden] -> [batch, seq, hidden] map")
        try:
            match = Analysis(traced, mask_arg, cache_args[0]).run()
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:  # never crash fuse()
            raise NoMatch(f"structure not understood: {type(exc).__name__}: {exc}") from exc
        with inference_mode_flag(module):
            _probe(module, match)
        return match

    @classmethod
    def apply(cls, module: nn.Module, match: MambaMatch, qualname: str) -> FusionRow:
        """Bind the fused forward to this instance; decline (fallback row) when the cache cannot be addressed."""
        row = FusionRow(qualname, type(module).__name__, cls.name, "fallback")
        if plan_of(module, "mamba") is not None:
            row.status, row.reason = "fused", "already fused"
            return row
        if not isinstance(getattr(module, "layer_idx", None), int):
            row.reason = "the mixer has no integer layer_idx: its cache states cannot be addressed"
            return row
        missing = compat.missing_mamba_cache_methods()
        if missing:
            low = ".".join(map(str, compat.FEATURE_MIN_VERSION["mamba"]))
            row.reason = f"the installed transformers' Cache lacks {missing} (Mamba fusion needs transformers>={low})"
            return row
        signature = forward_signature(module)
        original, why_not = bind_instance_forward(module, fused_forward, wrap_own=True)
        if original is None:
            row.reason = why_not
            return row
        set_plan(module, "mamba", MambaPlan(match, original, signature))
        row.status, row.reason = "fused", match.describe()
        return row


# ---------------------------------------------------------------------------------------------------------
# the probe


def _probe(module: nn.Module, match: MambaMatch) -> None:
    """Run the fused computation (torch twins) against the original forward on a small left-padded input."""
    weight = projection_weight(module)
    if weight.device.type == "meta":
        return
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(2, PROBE_LEN, module.get_submodule(match.in_proj).in_features, generator=gen,
                    device=weight.device).to(weight.dtype)
    kwargs = {}
    mask = None
    if match.mask_arg:
        mask = torch.ones(2, PROBE_LEN, dtype=torch.long, device=weight.device)
        mask[0, :2] = 0
        kwargs[match.mask_arg] = mask
    with torch.no_grad():
        try:
            want = type(module).forward(module, x, **kwargs)
            got = mixer_forward(module, match, REFERENCE, x, None, mask)
        except Exception as exc:  # the roles do not fit together after all
            raise NoMatch(f"fused forward failed on a probe input: {type(exc).__name__}: {exc}") from exc
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-12)).item()
    if not err <= (1e-3 if weight.dtype == torch.float32 else 5e-2):
        raise NoMatch(f"fused forward differs from the original on a probe input ({err:.1e} relative)")
