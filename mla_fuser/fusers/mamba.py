"""Mamba-1 and Mamba-2 mixers: recognised by structure, fused by binding a new forward to the instance.

How a mixer is recognised (never by class, attribute or parameter names):

* The forward is traced (``graph.py``'s meta tracer) with two additions: helper modules created on the fly
  (``ACT2FN[name](x)``) are traced through, and the mixer module's *kernel entry points* are single opaque
  nodes.  A kernel entry point is a function of the mixer's own module that wraps another function of that
  module (transformers resolves each at import: hub kernel, else ``mamba_ssm`` / ``causal_conv1d``, else the
  in-file torch reference).  So the graph is the same whichever implementation is installed, and the roles
  come from the arguments of two calls whose contract is ``mamba_ssm``'s: the causal conv
  ``(x, weight, bias, activation=)`` and the scan ``(x, dt, A, B, C, D=, z=, delta_bias= | dt_bias=, ...)``.
* The conv call is the one whose weight is read from a depthwise ``nn.Conv1d`` child; the scan call is the
  one whose ``A`` is ``-exp(P)`` of a parameter ``P`` of the mixer (that is ``A_log``).  ``P [I, N]`` and a
  3-D channel-first ``x`` make Mamba-1, ``P [H]`` and ``x [B, L, H, P]`` make Mamba-2.
* Every other role follows from data flow into those calls: the input projection is the linear on the
  hidden states whose output pieces feed the conv (and the gate, and Mamba-2's ``dt``); Mamba-1's ``x_proj``
  is the linear on the conv output whose pieces become ``dt`` / ``B`` / ``C`` (optionally through RMSNorms,
  weighted as in Jamba or parameter-free as in Falcon-Mamba), ``dt_proj`` the linear whose weight multiplies
  the ``dt`` piece; Mamba-2's gated RMSNorm is the module called on (scan output, gate); ``D``/``dt_bias``
  are the parameters passed as such; the output projection is the linear feeding the output.  Piece order
  and widths are read from the splits, heads/groups/state size from the shapes at the scan call.
* The trace runs with an all-ones padding mask, so the two places where the mixer zeroes padded positions
  (before the input projection, after the conv) are seen and reproduced.
* Anything left over declines the match, with the reason: an operation on the way to the output that is not
  a shape op or one of the roles, an extra kernel call, a parameter or child with parameters that plays no
  role.  Finally the fused forward (torch references) is run once against the original forward on a small
  random, left-padded input; a mismatch declines too.

``apply`` binds a forward to that one instance (the class and transformers' module functions are never
touched) which reproduces the original with ``mla_fuser.kernels``: prefill is causal conv + selective scan
(Mamba-1) or SSD chunk scan (Mamba-2) with final states, decode is the single-step conv update + state
update, in place on the cache's tensors (O(1) per token).  States go through the Cache API exactly as the
original mixer uses it (``get/update_conv_state``, ``get/update_recurrent_state``, ``is_recording_past``),
so ``generate()`` works unchanged.  Kernels dispatch per call (``MLA_FUSER_BACKEND``, ``kernels/dispatch.py``).
Training mode, packed-sequence arguments (``seq_idx``, ``cu_seqlens``) and caches without that API run the
original forward.  Mamba-1's original ignores the recurrent state for a multi-token step after a cached
prefix (it scans from zero); that is reproduced as is.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch import nn
from transformers.cache_utils import Cache

from .. import graph as g
from .. import compat
from ..kernels.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)
from ..kernels.selective_scan import (
    selective_scan,
    selective_scan_ref,
    selective_state_update,
    selective_state_update_ref,
)
from ..kernels.ssd import ssd_chunk_scan, ssd_chunk_scan_ref, ssd_state_update, ssd_state_update_ref
from .base import Fuser, FusionRow, NoMatch

PLAN_ATTR = "_mla_fuser_mamba_plan"
_PROBE_LEN = 5  # tokens of the trace / probe input; unlike any feature width, so axes are never confused
_PACKED_KWARGS = ("seq_idx", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")
_CACHE_METHODS = compat.MAMBA_CACHE_METHODS


@dataclass(frozen=True)
class MambaMatch:
    """Roles (submodule / parameter names) and sizes read from the graph.

    Pieces: ``in_split`` are the widths of the input projection's output pieces (feature axis) and
    ``x_piece`` / ``z_piece`` / ``dt_piece`` which piece is the conv input, the gate and (Mamba-2) ``dt``.
    ``x_split`` / ``pieces``: Mamba-1, the widths of ``x_proj``'s pieces and which are (dt, B, C);
    Mamba-2, the widths of the conv output's pieces and which are (x, B, C).
    """

    kind: str  # "mamba1" | "mamba2"
    in_proj: str
    conv1d: str
    out_proj: str
    a_log: str
    d: str | None
    in_split: tuple[int, ...]
    x_piece: int
    z_piece: int
    dt_piece: int | None
    x_split: tuple[int, ...]
    pieces: tuple[int, int, int]  # Mamba-1: (dt, B, C) of x_proj's output; Mamba-2: (x, B, C) of the conv output
    intermediate_size: int
    state_size: int
    conv_width: int
    activation: str | None
    dt_softplus: bool
    mask_arg: str | None  # the forward argument holding the 2-D padding mask
    mask_input: bool  # padded positions zeroed before the input projection
    mask_conv: bool  # ... and after the conv
    cache_arg: str = "cache"
    # Mamba-1
    x_proj: str | None = None
    dt_proj: str | None = None
    dt_norm: str | None = None
    b_norm: str | None = None
    c_norm: str | None = None
    dt_rank: int | None = None
    dt_proj_bias: bool = False
    # Mamba-2
    dt_bias: str | None = None
    norm: str | None = None
    num_heads: int | None = None
    head_dim: int | None = None
    n_groups: int | None = None
    dt_limit: tuple[float, float] = (0.0, float("inf"))

    def describe(self) -> str:
        if self.kind == "mamba1":
            norms = [r for r, n in (("dt", self.dt_norm), ("B", self.b_norm), ("C", self.c_norm)) if n]
            return (f"Mamba-1: inner {self.intermediate_size}, state {self.state_size}, dt rank {self.dt_rank}, "
                    f"conv {self.conv_width}" + (f", {'/'.join(norms)} RMSNorms" if norms else ""))
        return (f"Mamba-2: {self.num_heads} heads x {self.head_dim}, {self.n_groups} groups, state {self.state_size}, "
                f"conv {self.conv_width}, dt limit {self.dt_limit}")


@dataclass
class MambaPlan:
    """What the bound forward needs: the match, the original forward and its signature."""

    match: MambaMatch
    original: Callable
    signature: inspect.Signature


# ---------------------------------------------------------------------------------------------------------
# kernels: the dispatching ops for the fused forward, their torch twins for the probe


@dataclass(frozen=True)
class _Ops:
    conv: Callable
    conv_update: Callable
    scan: Callable
    scan_update: Callable
    ssd: Callable
    ssd_update: Callable


KERNELS = _Ops(causal_conv1d, causal_conv1d_update, selective_scan, selective_state_update, ssd_chunk_scan,
               ssd_state_update)
REFERENCE = _Ops(causal_conv1d_ref, causal_conv1d_update_ref, selective_scan_ref, selective_state_update_ref,
                 ssd_chunk_scan_ref, ssd_state_update_ref)


# ---------------------------------------------------------------------------------------------------------
# the fuser


class MambaFuser(Fuser):
    name = "mamba"

    @staticmethod
    def is_candidate(module: nn.Module) -> bool:
        """Cheap pre-filter: a depthwise ``nn.Conv1d`` child, two linear children and a parameter of its own."""
        children = list(module.children())
        return (
            any(_depthwise_conv(c) for c in children)
            and sum(isinstance(c, nn.Linear) for c in children) >= 2
            and any(True for _ in module.parameters(recurse=False))
        )

    @classmethod
    def _match(cls, module: nn.Module, example_inputs=None) -> MambaMatch:
        if not cls.is_candidate(module):
            raise NoMatch("no depthwise Conv1d child with linear projections and parameters of its own")
        signature = _forward_signature(module)
        params = [p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        cache_args = [p.name for p in params[1:] if g.is_cache_annotation(p.annotation)]
        if len(cache_args) != 1:
            raise NoMatch(f"expected one Cache argument in the forward, found {len(cache_args)}")
        tensor_args = [p.name for p in params[1:] if p.name not in cache_args and g.is_tensor_annotation(p.annotation)]
        if len(tensor_args) > 1:
            raise NoMatch(f"more than one tensor argument besides the hidden states: {tensor_args}")
        mask_arg = tensor_args[0] if tensor_args else None
        traced = None
        for width in _hidden_size_candidates(module, example_inputs):
            try:
                with _inference_mode_flag(module):
                    traced = _trace(module, params, width, mask_arg)
            except g.TraceError:
                continue
            out = g.meta_val(traced.output.args[0]) if traced.output.args else None
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (2, _PROBE_LEN, width):
                break
            traced = None
        if traced is None:
            raise NoMatch("the forward does not trace to a [batch, seq, hidden] -> [batch, seq, hidden] map")
        try:
            match = _Analysis(traced, mask_arg, cache_args[0]).run()
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:  # never crash fuse()
            raise NoMatch(f"structure not understood: {type(exc).__name__}: {exc}") from exc
        with _inference_mode_flag(module):
            _probe(module, match)
        return match

    @classmethod
    def apply(cls, module: nn.Module, match: MambaMatch, qualname: str) -> FusionRow:
        """Bind the fused forward to this instance; decline (fallback row) when the cache cannot be addressed."""
        row = FusionRow(qualname, type(module).__name__, cls.name, "fallback")
        if getattr(module, PLAN_ATTR, None) is not None:
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
        hooked = getattr(module, "_hf_hook", None) is not None and "_old_forward" in module.__dict__
        # under an accelerate hook (device_map dispatch, offload) replace what the hook wraps, so it keeps running
        plan = MambaPlan(match, module._old_forward if hooked else module.forward, _forward_signature(module))
        setattr(module, PLAN_ATTR, plan)
        fused = types.MethodType(_fused_forward, module)
        if hooked:
            module._old_forward = fused
        else:
            module.forward = fused
        row.status, row.reason = "fused", match.describe()
        return row


# ---------------------------------------------------------------------------------------------------------
# tracing


def _depthwise_conv(module) -> bool:
    return (
        isinstance(module, nn.Conv1d)
        and module.groups == module.in_channels == module.out_channels
        and module.weight.shape[1] == 1
    )


def _forward_signature(module: nn.Module) -> inspect.Signature:
    sig = inspect.signature(inspect.unwrap(type(module).forward))
    params = list(sig.parameters.values())
    return sig.replace(parameters=params[1:]) if params and params[0].name == "self" else sig


def _kernel_entries(module: nn.Module) -> list[Callable]:
    """Functions of the mixer's own module that wrap another function of that module (kernel entry points)."""
    forward = inspect.unwrap(type(module).forward)
    home = forward.__module__
    return [
        v for k, v in forward.__globals__.items()
        if not k.startswith("_") and inspect.isfunction(v) and v.__module__ == home
        and getattr(getattr(v, "__wrapped__", None), "__module__", None) == home
    ]


@contextlib.contextmanager
def _inference_mode_flag(module: nn.Module):
    """The mixer's own ``training`` flag off while it is traced / probed: the fused forward replaces the inference
    path (in training mode it runs the original), and a model built on the meta device is in training mode."""
    was = module.training
    module.training = False
    try:
        yield
    finally:
        module.training = was


def _projection_weight(module) -> torch.Tensor:
    """A linear child's weight: the dtype/device of the activations (``A_log`` is often kept in fp32)."""
    return next(c.weight for c in module.children() if isinstance(c, nn.Linear))


def _hidden_size_candidates(module, example_inputs) -> list[int]:
    if example_inputs is not None:
        args, kwargs = example_inputs
        first = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(first, torch.Tensor):
            return [int(first.shape[-1])]
    widths = [c.in_features for c in module.children() if isinstance(c, nn.Linear)]
    return sorted(set(widths), key=lambda w: (-widths.count(w), w))


def _trace(module, params, width, mask_arg) -> g.TracedModule:
    """Trace on a real ``[2, L, width]`` input (every op also runs for real) with an all-ones mask."""
    weight = _projection_weight(module)
    tracer = g.MetaTracer(module, opaque_functions=_kernel_entries(module))
    gen = torch.Generator(device=weight.device if weight.device.type != "meta" else "cpu").manual_seed(0)
    hidden = torch.randn(2, _PROBE_LEN, width, generator=gen, device=gen.device).to(weight.device, weight.dtype)
    tracer.placeholder_meta[params[0].name] = g.to_meta(hidden)
    if weight.device.type != "meta":
        tracer.placeholder_real[params[0].name] = hidden
    concrete = {}
    for p in params[1:]:
        if p.name == mask_arg:
            mask = torch.ones(2, _PROBE_LEN, dtype=torch.long, device=weight.device)
            tracer.placeholder_meta[p.name] = g.to_meta(mask)
            if weight.device.type != "meta":
                tracer.placeholder_real[p.name] = mask
        elif p.default is not inspect.Parameter.empty:
            concrete[p.name] = p.default
        else:
            raise g.TraceError(f"no value for forward argument {p.name!r}")
    return g.run_trace(module, tracer, concrete, params[0].name, width)


# ---------------------------------------------------------------------------------------------------------
# analysis of the traced graph


def _is_split(node) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_method", "call_function") and getattr(
        node.target, "__name__", node.target) in ("split", "chunk")


def _op_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


class _Analysis:
    """Roles of one traced mixer; every node the walks pass is recorded as accounted for."""

    def __init__(self, traced: g.TracedModule, mask_arg: str | None, cache_arg: str):
        self.t = traced
        self.module = traced.module
        self.mask_arg = mask_arg
        self.cache_arg = cache_arg
        self.seen: set[fx.Node] = set()
        self.mask_muls: dict[fx.Node, fx.Node] = {}  # mul node -> its data operand

    # -- walking ------------------------------------------------------------------------------------------

    def walk(self, node):
        """Back through shape ops and mask multiplies to the producer: ``(producer, piece)``, where piece is
        ``(split node, index)`` of the first split passed, or None."""
        piece = None
        while isinstance(node, fx.Node):
            self.seen.add(node)
            if node in self.mask_muls:
                node = self.mask_muls[node]
            elif node.op == "call_function" and node.target is operator.getitem and _is_split(node.args[0]):
                if piece is None:
                    piece = (node.args[0], node.args[1])
                node = node.args[0]
            elif g.is_shape_op(node):
                node = node.args[0]
            else:
                break
        return node, piece

    def submodule(self, node) -> nn.Module | None:
        return self.t.submodule(node) if isinstance(node, fx.Node) else None

    def param_of(self, node) -> str:
        """The mixer parameter an argument is (through shape ops / casts), as a dotted name."""
        src, _ = self.walk(node)
        if not (isinstance(src, fx.Node) and src.op == "get_attr"):
            raise NoMatch(f"{node} is not a parameter of the mixer")
        return src.target

    def a_log_of(self, node) -> str | None:
        """``P`` when ``node`` is ``-exp(P)`` for a parameter ``P`` of the mixer itself."""
        neg, _ = self.walk(node)
        if not (isinstance(neg, fx.Node) and _op_name(neg) == "neg"):
            return None
        exp, _ = self.walk(neg.args[0])
        if not (isinstance(exp, fx.Node) and _op_name(exp) == "exp"):
            return None
        src, _ = self.walk(exp.args[0])
        if src.op != "get_attr" or "." in src.target:
            return None
        self.seen.update((neg, exp))
        return src.target

    def pieces(self, split: fx.Node, width: int) -> tuple[int, ...]:
        """Widths of a split's pieces along its axis, which must be the feature axis of size ``width``."""
        src, out = g.meta_val(split.args[0]), g.meta_val(split)
        dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
        if not isinstance(src, torch.Tensor) or not isinstance(out, (tuple, list)) or src.shape[dim] != width:
            raise NoMatch(f"{split.name} does not split the {width} projected features")
        return tuple(int(piece.shape[dim]) for piece in out)

    # -- the analysis ---------------------------------------------------------------------------------------

    def run(self) -> MambaMatch:
        t, sub = self.t, self.submodule
        for target, nodes in t.nodes_by_module.items():
            if len(nodes) > 1:
                raise NoMatch(f"submodule {target!r} is called {len(nodes)} times")
        self.find_mask_muls()
        calls = [n for n in t.graph.nodes if n.op == "call_function" and n.target in _kernel_entries(self.module)]
        convs = [n for n in calls if self.conv_module(n) is not None]
        scans = [n for n in calls if self.a_log_of(_positional(n, 2)) is not None]
        if len(convs) != 1:
            raise NoMatch(f"expected one causal conv call on a depthwise Conv1d weight, found {len(convs)}")
        if len(scans) != 1:
            raise NoMatch(f"expected one selective-scan call with A = -exp(parameter), found {len(scans)}")
        others = [n for n in calls if n not in convs + scans]
        if others:
            raise NoMatch(f"unaccounted kernel call(s): {[n.name for n in others]}")
        conv, scan = convs[0], scans[0]
        self.seen.update((conv, scan))
        a_log = self.a_log_of(_positional(scan, 2))
        conv_mod = self.conv_module(conv)
        conv_args = inspect.signature(conv.target).bind(*conv.args, **conv.kwargs)
        activation = conv_args.arguments.get("activation")
        if activation not in (None, "silu", "swish"):
            raise NoMatch(f"conv activation {activation!r} is not SiLU")
        channels, width = conv_mod.weight.shape[0], conv_mod.weight.shape[-1]
        conv_in = g.meta_val(_positional(conv, 0))
        if not isinstance(conv_in, torch.Tensor) or conv_in.ndim != 3 or conv_in.shape[1] != channels:
            raise NoMatch("the conv input is not channel-first [batch, channels, seq]")

        # the input projection: the linear on the hidden states whose piece feeds the conv
        in_node, in_piece = self.walk(_positional(conv, 0))
        if not (g.is_linear(sub(in_node)) and in_piece is not None):
            raise NoMatch(f"the conv input is not a piece of a linear projection (it comes from {_op_name(in_node)!r})")
        if self.walk(in_node.args[0])[0] is not t.hidden:
            raise NoMatch("the projection feeding the conv does not take the hidden states")
        in_split = self.pieces(in_piece[0], sub(in_node).out_features)

        scan_args = _bound(scan)
        common = dict(in_proj=in_node.target, conv1d=self.conv_name(conv), a_log=a_log, in_split=in_split,
                      x_piece=in_piece[1], conv_width=int(width), activation=activation,
                      dt_softplus=bool(scan_args.get("delta_softplus", scan_args.get("dt_softplus", False))),
                      mask_arg=self.mask_arg if self.mask_muls else None, cache_arg=self.cache_arg,
                      mask_input=any(self.walk(d)[0] is t.hidden for d in self.mask_muls.values()),
                      mask_conv=any(self.walk(d)[0] is conv for d in self.mask_muls.values()))
        a_shape = tuple(self.module.get_parameter(a_log).shape)
        x_rank = getattr(g.meta_val(_positional(scan, 0)), "ndim", None)
        if len(a_shape) == 2 and x_rank == 3:
            match = self.mamba1(scan, scan_args, conv, in_node, in_piece[0], common, a_shape)
        elif len(a_shape) == 1 and x_rank == 4:
            match = self.mamba2(scan, scan_args, conv, in_node, in_piece[0], common, a_shape)
        else:
            raise NoMatch(f"A_log of shape {list(a_shape)} with a {x_rank}-D scan input is "
                          "neither Mamba-1 ([I, N], channel-first) nor Mamba-2 ([H], [B, L, H, P])")
        if self.mask_muls and not (match.mask_input and match.mask_conv):
            raise NoMatch("the padding mask is applied elsewhere than before the input projection and after the conv")
        self.account(match)
        return match

    def find_mask_muls(self):
        """Multiplications by ``mask[:, :, None]``; the mask must be used for nothing else."""
        mask = next((n for n in self.t.graph.nodes if n.op == "placeholder" and n.target == self.mask_arg), None)
        if mask is None or not mask.users:
            return
        for user in list(mask.users):
            self.seen.add(user)
            muls = [u for u in user.users if _op_name(u) == "mul" and len(u.args) == 2]
            if not (user.target is operator.getitem and muls and len(muls) == len(user.users)):
                raise NoMatch(f"the padding mask is used in an unrecognised way ({user.format_node()})")
            for mul in muls:
                self.mask_muls[mul] = mul.args[0] if mul.args[1] is user else mul.args[1]

    def conv_module(self, call: fx.Node) -> nn.Module | None:
        name = self.conv_name(call)
        return self.module.get_submodule(name) if name is not None else None

    def conv_name(self, call: fx.Node) -> str | None:
        src, _ = self.walk(_positional(call, 1))
        if not (isinstance(src, fx.Node) and src.op == "get_attr" and src.target.endswith(".weight")):
            return None
        owner = src.target[: -len(".weight")]
        return owner if _depthwise_conv(self.module.get_submodule(owner)) else None

    def norm_of(self, node):
        """``(norm name or None, producer, piece)`` for an argument that may pass one RMSNorm module."""
        src, piece = self.walk(node)
        mod = self.submodule(src)
        if mod is None or g.is_linear(mod):
            return None, src, piece
        if len(src.args) != 1 or src.kwargs:
            raise NoMatch(f"module {src.target!r} on the way to the scan takes more than one input")
        piece_width = g.meta_val(src.args[0]).shape[-1]
        if not _is_rmsnorm(mod, piece_width):
            raise NoMatch(f"module {src.target!r} on the way to the scan is not an RMSNorm")
        inner, piece = self.walk(src.args[0])
        return src.target, inner, piece

    def mamba1(self, scan, args, conv, in_node, in_split_node, common, a_shape) -> MambaMatch:
        sub = self.submodule
        inner, state = a_shape
        x, dt, B, C = (_positional(scan, i) for i in (0, 1, 3, 4))
        if self.walk(x)[0] is not conv:
            raise NoMatch("the scan input is not the conv output")
        z_src, z_piece = self.walk(args.get("z"))
        if z_src is not in_node or z_piece is None or z_piece[0] is not in_split_node:
            raise NoMatch("the scan gate z is not a piece of the input projection")
        # dt = W_dt @ piece: W_dt the weight of a linear child (its bias goes into the scan as delta_bias)
        matmul, _ = self.walk(dt)
        if not (isinstance(matmul, fx.Node) and _op_name(matmul) == "matmul"):
            raise NoMatch("dt reaches the scan other than as dt_proj.weight @ piece")
        self.seen.add(matmul)
        w = self.param_of(matmul.args[0])
        dt_proj = w[: -len(".weight")] if w.endswith(".weight") else None
        if dt_proj is None or not g.is_linear(self.module.get_submodule(dt_proj)):
            raise NoMatch("dt is not projected by a linear child's weight")
        dt_norm, xp, dt_piece = self.norm_of(matmul.args[1])
        b_norm, xp_b, b_piece = self.norm_of(B)
        c_norm, xp_c, c_piece = self.norm_of(C)
        if not (g.is_linear(sub(xp)) and xp is xp_b is xp_c and None not in (dt_piece, b_piece, c_piece)):
            raise NoMatch("dt, B and C are not pieces of one linear projection")
        if self.walk(xp.args[0])[0] is not conv:
            raise NoMatch("the dt/B/C projection does not take the conv output")
        x_split = self.pieces(dt_piece[0], sub(xp).out_features)
        bias = args.get("delta_bias")
        if bias is not None and self.param_of(bias) != f"{dt_proj}.bias":
            raise NoMatch("delta_bias is not the dt projection's bias")
        if bias is None and self.module.get_submodule(dt_proj).bias is not None:
            raise NoMatch("the dt projection's bias is not used as delta_bias")
        d = self.param_of(args["D"]) if args.get("D") is not None else None
        dt_rank = x_split[dt_piece[1]]
        in_split = common["in_split"]
        if (x_split[b_piece[1]], x_split[c_piece[1]]) != (state, state) or in_split[z_piece[1]] != inner:
            raise NoMatch(f"B/C widths {x_split} or input pieces {in_split} disagree with A_log [{inner}, {state}]")
        return MambaMatch(kind="mamba1", out_proj=self.out_proj(scan), d=d, z_piece=z_piece[1], dt_piece=None,
                          x_split=x_split, pieces=(dt_piece[1], b_piece[1], c_piece[1]), intermediate_size=inner,
                          state_size=state, x_proj=xp.target, dt_proj=dt_proj, dt_norm=dt_norm, b_norm=b_norm,
                          c_norm=c_norm, dt_rank=dt_rank, dt_proj_bias=bias is not None, **common)

    def mamba2(self, scan, args, conv, in_node, in_split_node, common, a_shape) -> MambaMatch:
        sub = self.submodule
        x, dt, B, C = (_positional(scan, i) for i in (0, 1, 3, 4))
        if args.get("z") is not None:
            raise NoMatch("the gate is applied inside the scan (no gated RMSNorm after it)")
        if args.get("initial_states") is not None:
            raise NoMatch("the scan starts from a state without a cache")
        pieces = [self.walk(v) for v in (x, B, C)]
        if any(src is not conv or piece is None for src, piece in pieces) or len({p[0] for _, p in pieces}) != 1:
            raise NoMatch("x, B and C are not pieces of the conv output")
        split = pieces[0][1][0]
        x_split = self.pieces(split, self.conv_module(conv).weight.shape[0])
        dt_src, dt_piece = self.walk(dt)
        if dt_src is not in_node or dt_piece is None or dt_piece[0] is not in_split_node:
            raise NoMatch("dt is not a piece of the input projection")
        heads = a_shape[0]
        _, _, x_heads, head_dim = g.meta_val(x).shape
        _, _, groups, state = g.meta_val(B).shape
        if x_heads != heads or tuple(g.meta_val(C).shape[2:]) != (groups, state) or heads % groups:
            raise NoMatch(f"heads {x_heads} / groups {groups} at the scan disagree with A_log [{heads}]")
        d = self.param_of(args["D"]) if args.get("D") is not None else None
        dt_bias = self.param_of(args["dt_bias"]) if args.get("dt_bias") is not None else None
        limit = tuple(float(v) for v in args.get("dt_limit", (0.0, float("inf"))))
        # y = norm(scan output, gate), then the output projection
        out_proj = self.out_proj_node()
        norm, _ = self.walk(out_proj.args[0])
        if sub(norm) is None or len(norm.args) != 2 or norm.kwargs:
            raise NoMatch("the output projection is not fed by a gated norm(y, gate)")
        if self.walk(norm.args[0])[0] is not scan:
            raise NoMatch("the gated norm does not normalise the scan output")
        z_src, z_piece = self.walk(norm.args[1])
        if z_src is not in_node or z_piece is None or z_piece[0] is not in_split_node:
            raise NoMatch("the norm's gate is not a piece of the input projection")
        self.seen.add(norm)
        return MambaMatch(kind="mamba2", out_proj=out_proj.target, d=d, z_piece=z_piece[1], dt_piece=dt_piece[1],
                          x_split=x_split, pieces=(pieces[0][1][1], pieces[1][1][1], pieces[2][1][1]),
                          intermediate_size=heads * head_dim, state_size=int(state), dt_bias=dt_bias, norm=norm.target,
                          num_heads=heads, head_dim=int(head_dim), n_groups=int(groups), dt_limit=limit, **common)

    def out_proj_node(self) -> fx.Node:
        node = g.linear_feeding_output(self.t)
        if node is None:
            raise NoMatch("no single output projection feeds the output")
        return node  # that nothing follows it is checked by ``account``

    def out_proj(self, scan) -> str:
        node = self.out_proj_node()
        if self.walk(node.args[0])[0] is not scan:
            raise NoMatch("the output projection does not take the scan output")
        return node.target

    def account(self, match: MambaMatch) -> None:
        """Decline anything on the way to the output, or any parameter, that plays no role."""
        t = self.t
        needed, frontier = set(), [t.output]
        while frontier:
            node = frontier.pop()
            if node not in needed:
                needed.add(node)
                frontier.extend(node.all_input_nodes)
        roles = {match.in_proj, match.out_proj, match.x_proj, match.dt_norm, match.b_norm, match.c_norm, match.norm}
        for node in t.graph.nodes:
            if node not in needed or node.op in ("placeholder", "output") or node in self.seen or g.is_shape_op(node):
                continue
            if node.op == "call_module" and node.target in roles:
                continue
            if node.op == "call_function" and _op_name(node) == "_assert_is_none":
                continue  # fx's guard on an argument specialised to None
            raise NoMatch(f"unaccounted operation on the way to the output: {node.format_node()}")
        params = {match.a_log, match.d, match.dt_bias} - {None}
        extra = [n for n, _ in self.module.named_parameters(recurse=False) if n not in params]
        if extra:
            raise NoMatch(f"unaccounted parameter(s): {extra}")
        owners = roles | {match.conv1d, match.dt_proj}
        for name, child in self.module.named_children():
            if name not in owners and (any(True for _ in child.parameters()) or any(True for _ in child.buffers())):
                raise NoMatch(f"unaccounted submodule {name!r} ({type(child).__name__})")


def _positional(call: fx.Node, index: int):
    """The argument bound to the call's ``index``-th parameter (passed by position or keyword), or None."""
    params = list(inspect.signature(call.target).parameters.values())
    if index < len(call.args):
        return call.args[index]
    return call.kwargs.get(params[index].name) if index < len(params) else None


def _bound(call: fx.Node) -> dict:
    """Every argument of the call by parameter name, defaults filled in, ``**kwargs`` flattened."""
    signature = inspect.signature(call.target)
    bound = signature.bind(*call.args, **call.kwargs)
    bound.apply_defaults()
    args = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind == param.VAR_KEYWORD:
            args.update(args.pop(name, {}))
    return args


def _is_rmsnorm(module: nn.Module, width: int) -> bool:
    """RMSNorm by computation: weighted (``graph.rmsnorm_width``) or parameter-free (Falcon-Mamba's)."""
    if g.rmsnorm_width(module) == width:
        return True
    if any(True for _ in module.parameters()) or any(True for _ in module.children()):
        return False
    try:
        traced = g.trace_module(module, width)
    except g.TraceError:
        return False
    names = [_op_name(n) for n in traced.graph.nodes if n.op in ("call_method", "call_function")]
    squares = any(
        (_op_name(n) == "pow" and len(n.args) > 1 and n.args[1] == 2) or _op_name(n) == "square"
        or (_op_name(n) == "mul" and len(n.args) == 2 and n.args[0] is n.args[1])
        for n in traced.graph.nodes if n.op in ("call_method", "call_function")
    )
    return "mean" in names and squares and ("rsqrt" in names or "sqrt" in names) and not (
        {"sub", "var", "layer_norm"} & set(names))


# ---------------------------------------------------------------------------------------------------------
# the fused forward


def _fused_forward(self: nn.Module, *args, **kwargs):
    """Bound to one mixer instance by ``MambaFuser.apply``: the original's arguments, our kernels."""
    plan: MambaPlan = getattr(self, PLAN_ATTR)
    try:
        bound = plan.signature.bind(*args, **kwargs)
    except TypeError:
        return plan.original(*args, **kwargs)
    arguments = dict(bound.arguments)
    first = next(iter(plan.signature.parameters))
    extra = {}
    for name, param in plan.signature.parameters.items():
        if param.kind == param.VAR_KEYWORD:
            extra = arguments.pop(name, {})
    cache = arguments.get(plan.match.cache_arg)
    if (
        self.training
        or any(extra.get(k) is not None for k in _PACKED_KWARGS)
        or any(isinstance(v, Cache) for v in extra.values())  # e.g. a deprecated keyword for the cache
        or (cache is not None and not all(hasattr(cache, m) for m in _CACHE_METHODS))
    ):
        return plan.original(*args, **kwargs)
    mask = arguments.get(plan.match.mask_arg) if plan.match.mask_arg else None
    from ..attention_interfaces.vllm_mla import loaded

    with contextlib.ExitStack() as stack:
        # weights read without calling their module (conv1d, dt_proj): loaded by their offload hooks, if any
        for name in (plan.match.conv1d, getattr(plan.match, "dt_proj", None)):
            if name:
                stack.enter_context(loaded(self.get_submodule(name)))
        return mixer_forward(self, plan.match, KERNELS, arguments[first], cache, mask)


def mixer_forward(module: nn.Module, m: MambaMatch, ops: _Ops, hidden_states, cache=None, mask=None):
    """The mixer's computation with ``ops`` (kernels or their torch twins), states through the Cache API."""
    layer_idx = module.layer_idx if cache is not None else None
    if m.kind == "mamba1":
        return _mamba1(module, m, ops, hidden_states, cache, mask, layer_idx)
    return _mamba2(module, m, ops, hidden_states, cache, mask, layer_idx)


def _masked(hidden_states, mask, enabled):
    """Zero padded positions as the original does: ``(h * mask[:, :, None]).to(h.dtype)``."""
    if mask is None or not enabled:
        return hidden_states
    return (hidden_states * mask[:, :, None]).to(hidden_states.dtype)


def _states(cache, layer_idx):
    if cache is None:
        return None, None
    return cache.get_conv_state(layer_idx, state_idx=0), cache.get_recurrent_state(layer_idx, state_idx=0)


def _conv(module, m, ops, x, cache, conv_state, layer_idx):
    """Causal conv over ``x [B, C, L]``: one-step update in place on the cached window when decoding, else
    the full conv over what the cache returns (the new tokens, left-padded or behind the cached window)."""
    seq_len = x.shape[-1]
    conv = module.get_submodule(m.conv1d)
    weight, bias = conv.weight.squeeze(1), conv.bias
    recording = cache is not None and getattr(cache, "is_recording_past", lambda i: False)(layer_idx)
    if conv_state is not None and seq_len == 1 and not recording:
        return ops.conv_update(x, conv_state, weight, bias, m.activation)
    if cache is not None:
        x = cache.update_conv_state(x, layer_idx, conv_kernel_size=m.conv_width)
    out = ops.conv(x, weight, bias, m.activation)
    return out[:, :, -seq_len:] if cache is not None else out


def _norm(module, name, x):
    return module.get_submodule(name)(x) if name else x


def _mamba1(module, m, ops, hidden_states, cache, mask, layer_idx):
    seq_len, dtype = hidden_states.shape[1], hidden_states.dtype
    conv_state, ssm_state = _states(cache, layer_idx)
    hidden_states = _masked(hidden_states, mask, m.mask_input)
    pieces = module.get_submodule(m.in_proj)(hidden_states).transpose(1, 2).split(m.in_split, dim=1)
    x, z = pieces[m.x_piece], pieces[m.z_piece]  # [B, I, L] each
    x = _conv(module, m, ops, x, cache, conv_state, layer_idx)
    x = _masked(x.transpose(1, 2), mask, m.mask_conv)  # [B, L, I]
    parts = module.get_submodule(m.x_proj)(x).split(m.x_split, dim=-1)
    dt, B, C = (parts[i] for i in m.pieces)
    dt, B, C = _norm(module, m.dt_norm, dt), _norm(module, m.b_norm, B), _norm(module, m.c_norm, C)
    dt_proj = module.get_submodule(m.dt_proj)
    dt = dt_proj.weight @ dt.transpose(1, 2)  # [B, I, L]; the bias is added inside the scan
    dt_bias = dt_proj.bias.float() if m.dt_proj_bias else None
    A = -torch.exp(module.get_parameter(m.a_log).float())
    D = module.get_parameter(m.d) if m.d else None
    if ssm_state is not None and seq_len == 1:
        y = ops.scan_update(ssm_state, x[:, 0], dt[..., 0], A, B[:, 0], C[:, 0], D, z=z[..., 0], dt_bias=dt_bias,
                            dt_softplus=m.dt_softplus).unsqueeze(-1)
    else:
        D = D.float() if D is not None else None
        y = ops.scan(x.transpose(1, 2), dt, A, B.transpose(1, 2), C.transpose(1, 2), D, z, dt_bias, m.dt_softplus,
                     cache is not None)
        if cache is not None:
            y, last_state = y
            cache.update_recurrent_state(last_state, layer_idx)
    return module.get_submodule(m.out_proj)(y.transpose(1, 2).to(dtype))


def _mamba2(module, m, ops, hidden_states, cache, mask, layer_idx):
    batch, seq_len, _ = hidden_states.shape
    dtype = hidden_states.dtype
    heads, head_dim, groups, state = m.num_heads, m.head_dim, m.n_groups, m.state_size
    conv_state, ssm_state = _states(cache, layer_idx)
    hidden_states = _masked(hidden_states, mask, m.mask_input)
    pieces = module.get_submodule(m.in_proj)(hidden_states).split(m.in_split, dim=-1)
    gate, xbc, dt = pieces[m.z_piece], pieces[m.x_piece], pieces[m.dt_piece]
    xbc = _conv(module, m, ops, xbc.transpose(1, 2), cache, conv_state, layer_idx)
    xbc = _masked(xbc.transpose(1, 2), mask, m.mask_conv)
    parts = xbc.split(m.x_split, dim=-1)
    x, B, C = (parts[i] for i in m.pieces)
    A = -torch.exp(module.get_parameter(m.a_log).float())
    D = module.get_parameter(m.d) if m.d else None
    dt_bias = module.get_parameter(m.dt_bias) if m.dt_bias else None
    if ssm_state is not None and seq_len == 1:
        # decode: no dt clamp, as in the original's (and mamba_ssm's) step
        y = ops.ssd_update(ssm_state, x.view(batch, heads, head_dim), dt[:, 0], A, B.view(batch, groups, state),
                           C.view(batch, groups, state), D, z=None, dt_bias=dt_bias, dt_softplus=m.dt_softplus)
        y = y.view(batch, 1, -1)
    else:
        y, final_state = ops.ssd(
            x.view(batch, seq_len, heads, head_dim), dt, A, B.view(batch, seq_len, groups, state),
            C.view(batch, seq_len, groups, state), 256, D, None, dt_bias, m.dt_softplus, ssm_state, m.dt_limit,
        )
        if cache is not None:
            cache.update_recurrent_state(final_state, layer_idx)
        y = y.reshape(batch, seq_len, -1)
    y = module.get_submodule(m.norm)(y, gate)
    return module.get_submodule(m.out_proj)(y.to(dtype))


# ---------------------------------------------------------------------------------------------------------
# the probe


def _probe(module: nn.Module, match: MambaMatch) -> None:
    """Run the fused computation (torch twins) against the original forward on a small left-padded input."""
    weight = _projection_weight(module)
    if weight.device.type == "meta":
        return
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(2, _PROBE_LEN, module.get_submodule(match.in_proj).in_features, generator=gen,
                    device=weight.device).to(weight.dtype)
    kwargs = {}
    mask = None
    if match.mask_arg:
        mask = torch.ones(2, _PROBE_LEN, dtype=torch.long, device=weight.device)
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
