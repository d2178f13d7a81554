"""The router child of a fused MoE block, on the logits and selection kernels once its first run shows they compute it.

DeepSeek-V2's router child (``self.gate(hidden)``) returns ``(logits, weights, ids)`` through fp32 casts,
``F.linear``, softmax, ``topk`` and a scale: about eight launches per layer in a decode step.  The block's match
(``RouterSpec``) says what the routing computes; when that computation lives in one child that owns the router
weight, this binds to that child *instance* a forward of two launches: the logits from one of
``kernels.moe_router``'s logits kernels (a decode step's few rows, or a continuous-batching or prefill step's hundreds
of 16-bit rows: ``moe_router.logits_path``, unless ``MLA_FUSER_ROUTER_LOGITS_KERNEL=0``) or from the traced ops (the
same ops, bitwise the same logits), then ``kernels.moe_router.select_experts``.

Nothing is assumed about what the child returns: its first call on a GPU (or under Triton's interpreter) runs the
original forward, and the binding is kept for that kind of call (input dtype, device, which logits) only if the
original returned ``(logits, weights, ids)`` and (a) the logits equal ours: bitwise from the traced ops, within
``LOGITS_RTOL`` of the terms' absolute total from the kernel (fp32 summation order), (b) the torch twin's experts
and weights on the original's logits equal the original's as sets per row, (c) ours equal the twin's except on
rows where the last chosen and the first left out are within ``TIE_GAP`` (widened by the row's logit deviation:
summation order may pick either there).  Otherwise (a router returning logits only, as DeepSeek-V3's does, or
anything else) the original forward runs, always.  It also runs on CPU
without the interpreter, under torch.compile, while autograd records, with other arguments, and on a first call
made inside a CUDA-graph capture.  The kernel's ids come out by decreasing choice; the original's order is
``topk(sorted=False)``'s; the experts implementation sums them in any order.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ... import envs
from ...fx_ops import attr_of
from ...kernels.dispatch import use_triton
from ...kernels.moe_router import (INPUT_DTYPES, MAX_POST, RouteParams, logits_path, router_logits_ref,
                                   router_logits_triton, rows_per_program, scores_and_choice, select_experts,
                                   select_experts_ref)
from ...plans import plan_of, set_plan
from ..base import bind_instance_forward
from .specs import MoEMatch, RouterSpec

_FP32 = torch.float32
TIE_GAP = 1e-5  # relative margin below which a top-k boundary may legitimately fall either way
# the logits kernel against the traced F.linear: at most this times the sum of the terms' magnitudes apart (fp32
# summation orders differ by ~log2(hidden) ulps of that sum; 1e-5 is ~170 ulps)
LOGITS_RTOL = 1e-5


@functools.lru_cache(maxsize=64)
def route_params(spec: RouterSpec) -> RouteParams | None:
    """The selection kernel's constants for ``spec``, or None when the kernel would not compute what was traced:
    every cast before selection must be to fp32 (DeepSeek-V2/V3 route in fp32), the steps a renorm first, at most
    two scale / div steps, and one cast at the end."""
    casts = (*spec.input_dtypes, *spec.weight_dtypes, *spec.logits_dtypes, *spec.score_dtypes,
             *spec.correction_bias_dtypes)
    if any(dtype != _FP32 for dtype in casts) or spec.softmax_dtype not in (None, _FP32):
        return None
    if spec.n_group is not None and spec.group_scoring not in ("max", "topn_sum"):
        return None
    renorm, eps, post, out_dtype = False, None, [], _FP32
    for i, (op, arg) in enumerate(spec.steps):
        if op == "renorm" and i == 0:
            renorm, eps = True, arg
        elif op in ("scale", "div") and out_dtype == _FP32:
            post.append((op, float(arg)))
        elif op not in ("renorm", "scale", "div") and out_dtype == _FP32 and arg in INPUT_DTYPES:
            out_dtype = arg  # a cast: to fp32 changes nothing; to fp16 / bf16 only as the last step
        else:
            return None
    if len(post) > MAX_POST:
        return None
    grouped = spec.n_group is not None
    return RouteParams(
        top_k=spec.top_k, scoring=spec.scoring, n_group=spec.n_group if grouped else 0,
        topk_group=spec.topk_group if grouped else 0,
        group_topn=spec.group_topn if grouped and spec.group_scoring == "topn_sum" else 0,
        group_fill=float(spec.group_fill) if grouped else 0.0, weights_from=spec.weights_from, renorm=renorm,
        renorm_eps=None if eps is None else float(eps), post=tuple(post), out_dtype=out_dtype,
    )


class _RouterPlan:
    """What the bound forward of one router child needs: the original forward, the spec's names relative to the
    child, the kernel's constants, and the verdict per kind of call (True: the kernel; False: the original)."""

    def __init__(self, original, spec: RouterSpec, params: RouteParams, prefix: str):
        self.original, self.spec, self.params = original, spec, params
        self.weight = spec.linear[len(prefix):]
        self.bias = spec.linear_bias[len(prefix):] if spec.linear_bias else None
        self.correction = spec.correction_bias[len(prefix):] if spec.correction_bias else None
        self.verdicts: dict = {}

    def tensors(self, child):
        return (attr_of(child, self.weight), attr_of(child, self.bias) if self.bias else None,
                attr_of(child, self.correction) if self.correction else None)

    def logits(self, tensors, x):
        """The router logits as the traced ops make them (the spec's casts, ``F.linear``); ``tensors`` are
        :meth:`tensors`' (read once per call)."""
        weight, bias, _ = tensors
        for dtype in self.spec.input_dtypes:
            x = x.to(dtype)
        for dtype in self.spec.weight_dtypes:
            weight = weight.to(dtype)
        logits = F.linear(x, weight, bias)
        for dtype in self.spec.logits_dtypes:
            logits = logits.to(dtype)
        return logits

    def logits_on_kernel(self, tensors, flat) -> str:
        """Which logits kernel this call's logits come from (``moe_router.logits_path``; "" for the traced ops): the
        traced casts are all to fp32 (what the kernels compute in), and a kernel takes the rows and the gate.  Each
        kernel is a kind of call of its own, checked against the original once."""
        weight, bias, _ = tensors
        return logits_path(flat, weight, bias) if envs.router_logits_kernel() else ""

    def ours(self, tensors, flat, on_kernel: str):
        """This binding's ``(logits, weights, ids)`` for the rows ``flat [T, H]``."""
        if on_kernel:  # (the kernel logits_on_kernel chose, not chosen again)
            logits = router_logits_triton(flat, tensors[0], tensors[1],
                                          block_m=rows_per_program(on_kernel, flat.shape[0]))
        else:
            logits = self.logits(tensors, flat)
        return (logits, *select_experts(logits, tensors[2], self.params))

    def usable(self, tensors, x) -> bool:
        weight, _, correction = tensors
        return (x.dim() >= 2 and x.shape[-1] == weight.shape[-1] and x.device == weight.device
                and self.params.fits(weight.shape[0])
                and (correction is None or correction.dtype in INPUT_DTYPES)
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))

    @staticmethod
    def kind(tensors, x, on_kernel: str):
        return x.dtype, tensors[0].dtype, x.device.type, on_kernel

    def check(self, tensors, x, out, on_kernel: str = ""):
        """This binding's result on ``x`` (logits from the kernel or not, ``on_kernel``) when ``out`` (the
        original's) agrees with it (module docstring), else None."""
        if not (isinstance(out, tuple) and len(out) == 3 and all(type(t) is torch.Tensor for t in out)):
            return None
        logits_o, weights_o, ids_o = out
        flat = x.reshape(-1, x.shape[-1])
        ours = self.ours(tensors, flat, on_kernel)
        logits = ours[0]
        if logits_o.shape != logits.shape or logits_o.dtype != logits.dtype:
            return None
        deviation = None  # (per row, where the kernel's logits may differ from the traced ones)
        if on_kernel:
            weight, bias, _ = tensors  # (the terms' absolute total: the twin on magnitudes)
            total = router_logits_ref(flat.abs(), weight.abs(), None if bias is None else bias.abs())
            apart = (logits - logits_o).abs()
            if not bool((apart <= LOGITS_RTOL * total).all()):
                return None
            deviation = apart.amax(dim=-1)
        elif not torch.equal(logits_o, logits):
            return None
        correction = tensors[2]
        twin = select_experts_ref(logits_o, correction, self.params)
        k = self.params.top_k
        if weights_o.shape != (flat.shape[0], k) or ids_o.shape != weights_o.shape or ids_o.dtype != torch.int64 \
                or weights_o.dtype != twin[0].dtype:
            return None
        if not _same_sets((weights_o, ids_o), twin, torch.zeros(flat.shape[0], dtype=torch.bool, device=x.device)):
            return None
        if not _same_sets(ours[1:], twin, _near_ties(logits_o, correction, self.params, deviation),
                          slack=0.0 if deviation is None else 4 * float(deviation.max())):
            return None
        return ours


def _as_sets(weights, ids):
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(-1, order), ids_sorted


def _same_sets(got, want, excused, slack: float = 0.0) -> bool:
    """The same experts with the same weights per row (fp32 summation order aside: 1e-5 relative plus ``slack``,
    or one unit of a 16-bit output dtype, whose rounding that order may tip), rows in ``excused`` aside."""
    w_got, i_got = _as_sets(*got)
    w_want, i_want = _as_sets(*want)
    keep = ~excused
    if w_got.dtype != w_want.dtype or not torch.equal(i_got[keep], i_want[keep]):
        return False
    rtol = max(1e-5 + slack, torch.finfo(w_want.dtype).eps)
    return torch.allclose(w_got[keep].float(), w_want[keep].float(), rtol=rtol, atol=1e-7)


def _near_ties(logits, correction, params: RouteParams, deviation=None):
    """Rows whose k-th and (k+1)-th choices (the twin's, before any group limit) are within ``TIE_GAP`` relative,
    plus four times the row's largest logit ``deviation`` absolute where given (logits moved by at most d move a
    softmax or sigmoid score by at most 2d relative, so by at most 2d absolute as scores are at most 1; a
    correction bias moves both boundary choices alike)."""
    k = params.top_k
    if k >= logits.shape[-1]:
        return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    _, choice = scores_and_choice(logits, correction, params)
    top = choice.topk(k + 1, dim=-1).values
    gap = TIE_GAP * top[:, k - 1].abs().clamp(min=1e-30)
    return (top[:, k - 1] - top[:, k]).abs() <= (gap if deviation is None else gap + 4 * deviation)


def _fused_router_forward(self: nn.Module, hidden_states, *args, **kwargs):
    plan = plan_of(self, "router")
    if (args or kwargs or type(hidden_states) is not torch.Tensor or not use_triton(hidden_states)
            or torch.compiler.is_compiling()):  # (first: on CPU, where this ends every call, nothing else is read)
        return plan.original(hidden_states, *args, **kwargs)
    tensors = plan.tensors(self)  # (the router's tensors, read once for this call)
    if not plan.usable(tensors, hidden_states):
        return plan.original(hidden_states)
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    on_kernel = plan.logits_on_kernel(tensors, flat)
    kind = plan.kind(tensors, hidden_states, on_kernel)
    verdict = plan.verdicts.get(kind)
    if verdict is None:
        if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
            return plan.original(hidden_states)  # the check reads results back: not inside a capture
        out = plan.original(hidden_states)
        ours = plan.check(tensors, hidden_states, out, on_kernel)
        plan.verdicts[kind] = ours is not None
        # the checking call returns what every later call of its kind will (the kernel's routing once adopted:
        # a first call routed by torch and later ones by the kernel could order or round differently)
        return out if ours is None else ours
    if not verdict:
        return plan.original(hidden_states)
    return plan.ours(tensors, flat, on_kernel)


def bind_router(block: nn.Module, match: MoEMatch) -> str:
    """Bind the fused router forward to the child of ``block`` that holds the whole routing, or say why not."""
    spec = match.router
    params = route_params(spec)
    if params is None:
        return "router on torch (a cast, step or group scoring the selection kernel does not take)"
    if spec.linear_is_module or "." not in spec.linear:
        return "router on torch (the routing is not inside one child of the block)"
    prefix = spec.linear.rsplit(".", 1)[0] + "."
    names = [spec.linear_bias, spec.correction_bias]
    if any(n is not None and not n.startswith(prefix) for n in names):
        return "router on torch (its tensors live in different children)"
    try:
        child = block.get_submodule(prefix[:-1])
    except AttributeError:
        return "router on torch (no router child)"
    if not params.fits(attr_of(block, spec.linear).shape[0]):
        return "router on torch (more experts or a larger top-k than the selection kernel holds)"
    if isinstance(plan_of(child, "router"), _RouterPlan):
        return "router child on the logits and selection kernels once checked (already)"
    original, why_not = bind_instance_forward(child, _fused_router_forward)
    if original is None:
        return f"router on torch ({why_not})"
    set_plan(child, "router", _RouterPlan(original, spec, params, prefix))
    return (f"router child {prefix[:-1]!r} on the logits and selection kernels once its first GPU call of each kind "
            "agrees")
