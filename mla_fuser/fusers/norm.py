"""RMSNorm modules, recognised by what they compute, run as one kernel (``kernels.rms_norm``).

Transformers writes each RMSNorm as a handful of torch ops; in a decode step those are ~7 tiny launches per
norm.  This fuser binds, to each matching *instance* (never its class), a forward that calls ``rms_norm``.

What is matched (never by class or attribute names):

* **candidates**: leaf modules with exactly one parameter, a 1-D weight, and no buffers, that
  ``graph.rmsnorm_width`` recognises as an RMSNorm by computation;
* **the traced forward**, read by a small abstract interpreter: every node gets a role (the input ``x``, the
  squares, their mean, ``mean + eps``, ``rsqrt``, the normalised row ``n``, ``n`` cast back to the input dtype,
  the weight, ``1 + weight``, the weighted products, the final cast) only when its op and its operands' roles
  and dtypes form a known step; anything else declines, naming the op.  From the graph come ``eps`` (the float
  added to the mean of squares), the weight offset (an ``add`` of the weight and 1, and the dtype it is
  added in) and the variant (weight times the row already cast back to the input dtype, or a product in fp32
  cast at the end).  The module is traced twice, on bfloat16 and on float16 meta inputs: a cast "back to the
  input dtype" must follow the input in both, so a hard-coded dtype is not mistaken for it, and fp32 math is
  told apart from input-dtype math;
* **declined**: a subtracted mean (LayerNorm), a second parameter or a buffer, ``F.rms_norm`` /
  ``nn.RMSNorm`` (already one kernel), ``pow(v, -0.5)`` or ``1 / sqrt(v)`` in place of ``rsqrt`` (other
  roundings), a forward taking more than the hidden states (gated norms), an input dtype the kernel does
  not take, weights on the meta device.

How it is fused: ``apply`` binds ``_fused_forward`` to the instance (under an accelerate hook, to what the hook
wraps).  The weight is read from the module at every call, so loading weights or ``.to()`` later still works;
a call the match cannot vouch for (extra arguments, another dtype or width) runs the original forward, as does an
eager call on CPU tensors where no Triton runs (the kernel's torch twin there is the module's very ops).  Before
keeping it, the bound forward is compared with the original on random inputs, with the module's weight and
with a random one: bitwise on CPU (the torch reference is the same ops); when the Triton kernel runs, whose
reduction order differs from torch's, within the units in the last place that order can move (``_max_ulps``).
A mismatch restores the original forward and reports a fallback.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.fx as fx
from torch import nn

from .. import graph as g
from ..fx_ops import CAST_METHODS, arg, is_number, meta_dtype, op_name
from ..kernels.dispatch import launches_are_free, use_triton
from ..kernels.rms_norm import KERNEL_DTYPES, rms_norm
from ..plans import clear_plan, plan_of, set_plan
from .base import Fuser, FusionRow, NoMatch, bind_instance_forward, shape_key, unbind_instance_forward

_TRACE_DTYPES = (torch.bfloat16, torch.float16)  # two 16-bit inputs: casts back to "the input dtype" are told apart


@dataclass(frozen=True)
class NormMatch:
    """What the graph says the norm computes (see ``kernels.rms_norm`` for the two variants)."""

    width: int
    eps: float
    weight_offset: float  # 0.0, or 1.0 for ``1 + weight``
    weight_in_fp32: bool  # weight applied in fp32 before the final cast (else after the cast back)
    weight_name: str
    weight_dtype: torch.dtype

    def describe(self) -> str:
        weight = "1 + weight" if self.weight_offset else "weight"
        where = "in fp32, then cast" if self.weight_in_fp32 else "after the cast back"
        return f"RMSNorm width {self.width}, eps {self.eps:g}, {weight} {where}"


class NormFuser(Fuser):
    name = "norm"

    @staticmethod
    def is_candidate(module: nn.Module) -> bool:
        """A leaf with one 1-D parameter that computes an RMSNorm (``graph.rmsnorm_width``)."""
        if next(module.children(), None) is not None:
            return False
        params = list(module.parameters(recurse=False))
        if len(params) != 1 or params[0].ndim != 1:
            return False
        return g.rmsnorm_width(module) is not None

    @classmethod
    def cache_key(cls, module: nn.Module, example_inputs=None) -> tuple:
        """The base key plus the weight dtype (the trace may branch on it) and the module's plain scalar
        attributes: ``eps`` is one of them, and two instances of a class may differ in it."""
        scalars = tuple(sorted((k, v) for k, v in vars(module).items()
                               if isinstance(v, (bool, int, float, str)) or v is None))
        dtypes = tuple(str(p.dtype) for p in module.parameters(recurse=False))
        return (shape_key(module, example_inputs), dtypes, scalars)

    @classmethod
    def _match(cls, module: nn.Module, example_inputs=None) -> NormMatch:
        weight_name, weight = _the_weight(module)
        if weight.dtype not in KERNEL_DTYPES:
            raise NoMatch(f"weight is {weight.dtype}: the kernel takes float16, bfloat16 or float32")
        width = int(weight.shape[0])
        _check_inputs(module, width, example_inputs)
        found = []
        for dtype in _TRACE_DTYPES:
            with warnings.catch_warnings():  # meta runs of the ops warn about dtypes (nn.RMSNorm does); analysis only
                warnings.simplefilter("ignore")
                traced = g.trace_module(module, hidden_size=width, dtype=dtype)
            found.append(_Interpreter(traced, weight_name, weight.dtype, dtype).run())
        if len(set(found)) != 1:
            raise NoMatch(f"the forward computes differently for {_TRACE_DTYPES[0]} and {_TRACE_DTYPES[1]} inputs")
        eps, offset, in_fp32 = found[0]
        return NormMatch(width, eps, offset, in_fp32, weight_name, weight.dtype)

    @classmethod
    def apply(cls, module: nn.Module, match: NormMatch, qualname: str) -> FusionRow:
        """Bind the fused forward to this instance, keep it only when it agrees with the original."""
        row = FusionRow(qualname, type(module).__name__, cls.name, "fallback")
        if isinstance(plan_of(module, "norm"), _NormPlan):
            row.status, row.reason = "fused", "already fused"
            return row
        weight = module._parameters.get(match.weight_name)
        if weight is None:
            row.reason = f"no parameter {match.weight_name!r} any more"
            return row
        if weight.device.type == "meta":
            row.reason = "meta weights: the fused forward cannot be checked"
            return row
        original, why_not = bind_instance_forward(module, _fused_forward)
        if original is None:
            row.reason = why_not
            return row
        set_plan(module, "norm", _NormPlan(match, original))
        problem = _check_against_original(module, match, original)
        if problem:
            unbind_instance_forward(module, original)
            clear_plan(module, "norm")
            row.reason = f"fused forward differs from the original: {problem}"
            return row
        row.status, row.reason = "fused", match.describe()
        return row


# ---------------------------------------------------------------------------------------------------------
# checks before tracing


def _the_weight(module: nn.Module) -> tuple[str, torch.Tensor]:
    params = list(module.named_parameters())
    if next(module.children(), None) is not None:
        raise NoMatch("has child modules")
    if len(params) != 1 or params[0][1].ndim != 1:
        raise NoMatch(f"expected one 1-D weight, found {len(params)} parameters")
    buffers = [n for n, _ in module.named_buffers()]
    if buffers:
        raise NoMatch(f"has buffers besides the weight: {buffers}")
    return params[0]


def _check_inputs(module: nn.Module, width: int, example_inputs) -> None:
    """The forward takes the hidden states only (a gated norm takes a second tensor), of a kernel dtype."""
    signature = inspect.signature(inspect.unwrap(type(module).forward))
    params = [p for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    params = params[1:] if params and params[0].name == "self" else params
    if len(params) != 1:
        raise NoMatch(f"forward takes {[p.name for p in params]}: more than the hidden states")
    if example_inputs is None:
        return
    args, kwargs = example_inputs
    given = list(args) + list(kwargs.values())
    if len(given) != 1 or not isinstance(given[0], torch.Tensor):
        raise NoMatch("called with more than the hidden states")
    x = given[0]
    if x.dtype not in KERNEL_DTYPES:
        raise NoMatch(f"input is {x.dtype}: the kernel takes float16, bfloat16 or float32")
    if x.shape[-1] != width:
        raise NoMatch(f"input width {x.shape[-1]} differs from the weight's {width}")


# ---------------------------------------------------------------------------------------------------------
# the graph, read role by role


class _Role(NamedTuple):
    kind: str  # x, sq, ms, mse, r, n, nc, w, p1, p2, out2
    eps: float | None = None
    offset: float = 0.0
    offset_dtype: torch.dtype | None = None  # the dtype ``weight + 1`` was computed in


class _Interpreter:
    """Gives every node of the traced norm a ``_Role``; returns ``(eps, weight_offset, weight_in_fp32)``."""

    def __init__(self, traced: g.TracedModule, weight_name: str, weight_dtype: torch.dtype, input_dtype):
        self.traced = traced
        self.weight_name = weight_name
        self.weight_dtype = weight_dtype
        self.input_dtype = input_dtype
        self.ndim = 3  # trace_module's synthetic input is [1, seq, width]
        self.roles: dict[fx.Node, _Role] = {}

    def run(self) -> tuple[float, float, bool]:
        for node in self.traced.graph.nodes:
            if node.op == "output":
                return self.output(node)
            self.roles[node] = self.step(node)
        raise NoMatch("the traced forward has no output")  # pragma: no cover - fx always adds one

    def role(self, value) -> _Role | None:
        return self.roles.get(value) if isinstance(value, fx.Node) else None

    def step(self, node: fx.Node) -> _Role:
        if node.op == "placeholder":
            if node is not self.traced.hidden:
                raise NoMatch(f"forward input {node.target!r} besides the hidden states")
            return _Role("x")
        if node.op == "get_attr":
            if node.target != self.weight_name:
                raise NoMatch(f"reads the tensor attribute {node.target!r} besides the weight")
            return _Role("w")
        if node.op not in ("call_method", "call_function"):
            raise NoMatch(f"calls {node.op} {node.target!r}")
        name = op_name(node)
        handler = getattr(self, f"op_{name}", None)
        if name in CAST_METHODS:
            handler = self.op_cast
        if handler is None:
            if name in ("rms_norm",):
                raise NoMatch("calls F.rms_norm (nn.RMSNorm): already one kernel")
            if name in ("sub", "var", "layer_norm"):
                raise NoMatch(f"{name}: subtracts a mean (LayerNorm), not an RMSNorm")
            if name in ("sqrt", "div"):
                raise NoMatch(f"{name}: divides by a square root instead of multiplying by rsqrt (other rounding)")
            raise NoMatch(f"{name}: an op that is not part of an RMSNorm")
        return handler(node)

    def unknown(self, node: fx.Node, what: str = "not a step of an RMSNorm") -> NoMatch:
        roles = [r.kind if (r := self.role(a)) else repr(a) for a in node.args]
        return NoMatch(f"{op_name(node)}({', '.join(roles)}): {what}")

    # casts: x up to fp32, the normalised row back to the input dtype, the weight up to fp32, the result
    def op_cast(self, node: fx.Node) -> _Role:
        src = self.role(node.args[0])
        before, after = meta_dtype(node.args[0]), meta_dtype(node)
        if src is None or before is None or after is None:
            raise self.unknown(node)
        if before == after:
            return src
        if src.kind in ("x", "w") and after == torch.float32:
            return src  # exact widening
        if src.kind == "n" and after == self.input_dtype:
            return src._replace(kind="nc")
        if src.kind == "p2" and after == self.input_dtype:
            return src._replace(kind="out2")
        if src.kind == "n":
            raise NoMatch(f"casts the normalised row to {after}, not to the input dtype ({self.input_dtype})")
        raise self.unknown(node, f"casts {src.kind} from {before} to {after}")

    def op_pow(self, node: fx.Node) -> _Role:
        base, exponent = node.args[0], arg(node, 1, "exponent")
        if exponent == -0.5:
            raise NoMatch("pow(v, -0.5) in place of rsqrt: another rounding")
        if exponent == 2:
            return self.square(node, base, base)
        raise self.unknown(node)

    def op_square(self, node: fx.Node) -> _Role:
        return self.square(node, node.args[0], node.args[0])

    def square(self, node, a, b) -> _Role:
        ra, rb = self.role(a), self.role(b)
        if ra == rb == _Role("x") and meta_dtype(a) == meta_dtype(b) == meta_dtype(node) == torch.float32:
            return _Role("sq")
        raise self.unknown(node, "is not the fp32 square of the input")

    def op_mean(self, node: fx.Node) -> _Role:
        src = self.role(node.args[0])
        dim, keepdim = arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
        dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
        if (src is None or src.kind != "sq" or dims not in ((-1,), (self.ndim - 1,)) or keepdim is not True
                or "dtype" in node.kwargs):
            raise self.unknown(node, "is not mean(x**2, -1, keepdim=True)")
        return _Role("ms")

    def op_add(self, node: fx.Node) -> _Role:
        if node.kwargs or len(node.args) != 2:
            raise self.unknown(node)
        a, b = node.args
        tensor, number = (a, b) if isinstance(a, fx.Node) else (b, a)
        src = self.role(tensor)
        if src is None or not is_number(number):
            raise self.unknown(node, "adds two tensors")
        if src.kind == "ms":
            return _Role("mse", eps=float(number))
        if src.kind == "w" and src.offset == 0.0 and number == 1:
            return src._replace(offset=1.0, offset_dtype=meta_dtype(node))
        raise self.unknown(node)

    def op_rsqrt(self, node: fx.Node) -> _Role:
        src = self.role(node.args[0])
        if src is None or src.kind != "mse":
            raise self.unknown(node, "is not rsqrt(mean(x**2) + eps)")
        return src._replace(kind="r")

    def op_mul(self, node: fx.Node) -> _Role:
        if node.kwargs or len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
            raise self.unknown(node, "scales by a constant")
        a, b = node.args
        ra, rb = self.role(a), self.role(b)
        if ra is None or rb is None:
            raise self.unknown(node)
        kinds = {ra.kind: (ra, a), rb.kind: (rb, b)}
        if ra.kind == rb.kind == "x":
            return self.square(node, a, b)
        if set(kinds) == {"x", "r"} and meta_dtype(node) == torch.float32:
            return _Role("n", eps=kinds["r"][0].eps)  # a 16-bit x is widened exactly by type promotion
        if set(kinds) == {"w", "nc"}:
            w, w_node = kinds["w"]
            if meta_dtype(w_node) != self.weight_dtype:
                raise NoMatch("the weight is cast before multiplying the row cast back to the input dtype")
            if w.offset and w.offset_dtype != self.weight_dtype:
                raise NoMatch("1 + weight is computed in another dtype than the weight's")
            return _Role("p1", eps=kinds["nc"][0].eps, offset=w.offset)
        if set(kinds) == {"w", "n"} and meta_dtype(node) == torch.float32:
            w = kinds["w"][0]
            if w.offset and w.offset_dtype != torch.float32:
                raise NoMatch(f"1 + weight is rounded to {w.offset_dtype} before an fp32 multiply")
            return _Role("p2", eps=kinds["n"][0].eps, offset=w.offset)
        raise self.unknown(node)

    def output(self, node: fx.Node) -> tuple[float, float, bool]:
        result = node.args[0] if node.args else None
        role = self.role(result)
        if role is None:
            raise NoMatch("the output is not a single tensor")
        if role.kind == "p1":
            return role.eps, role.offset, False
        if role.kind == "out2":
            return role.eps, role.offset, True
        if role.kind == "p2":
            raise NoMatch(f"returns {meta_dtype(result)} for a {self.input_dtype} input (no cast back)")
        if role.kind in ("n", "nc"):
            raise NoMatch("the weight is not applied to the output")
        raise NoMatch(f"the output is {role.kind}, not a normalised, weighted row")


# ---------------------------------------------------------------------------------------------------------
# the bound forward and its check


@dataclass
class _NormPlan:
    match: NormMatch
    original: Callable

    def runs_fused(self, x, weight) -> bool:
        m = self.match
        return (isinstance(x, torch.Tensor) and x.dtype in KERNEL_DTYPES and x.shape[-1] == m.width
                and weight.dtype == m.weight_dtype and weight.device == x.device)

    def kernel(self, x, weight):
        m = self.match
        return rms_norm(x, weight, m.eps, m.weight_offset, m.weight_in_fp32)


# Below this many rows an eager CUDA call runs the module's own ops: a Triton launch cost more host time (its
# Python launcher, ~70 us on an H200 host) than the seven small torch launches it replaces, and a few rows are
# host-bound.  With direct launches (kernels.direct_launch) the kernel's wrapper is cheaper per call, yet a whole
# eager step did not get faster with every norm on the kernel (host_overhead_gpu_norm_ab.json: 49.4 against 48.0 ms),
# so the threshold stays.  Captured (CUDA graph) and compiled calls, where launches are free, and many rows always
# fuse.
EAGER_MIN_ROWS = 2048


def _pays(x: torch.Tensor) -> bool:
    if not x.is_cuda or x.numel() >= EAGER_MIN_ROWS * x.shape[-1]:
        return True
    return launches_are_free()


def _fused_forward(self: nn.Module, *args, **kwargs):
    """Bound to one norm instance: ``rms_norm`` on the module's current weight; anything the match does not
    cover runs the original forward.  The matched forward takes one input, so a lone argument (positional or
    by its name) is the hidden states."""
    plan: _NormPlan = plan_of(self, "norm")
    if len(args) + len(kwargs) != 1:
        return plan.original(*args, **kwargs)
    x = args[0] if args else next(iter(kwargs.values()))
    if isinstance(x, torch.Tensor) and x.is_cpu and not torch.compiler.is_compiling() and not use_triton(x):
        # an eager CPU call: the torch backend would run the kernel's twin, the module's very ops (bitwise, as the
        # check at fusion made sure), so the module's own forward runs them, with no checks before it: on a CPU
        # this is every norm of a step, and each check costs host time the norm itself barely does
        return plan.original(x)
    m = plan.match
    weight = self._parameters[m.weight_name]
    if not plan.runs_fused(x, weight) or not _pays(x):
        return plan.original(*args, **kwargs)
    return plan.kernel(x, weight)


def _check_against_original(module: nn.Module, match: NormMatch, original: Callable) -> str:
    """Fused vs original on ``randn * 3`` rows plus a row of large values, with the module's weight and with a
    random one (a weight of ones cannot tell the variants apart).  '' when they agree."""
    weight = module._parameters[match.weight_name]
    dtype, device = weight.dtype, weight.device
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, match.width, generator=gen) * 3
    x[1, 2] = torch.randn(match.width, generator=gen) * min(1e4, torch.finfo(dtype).max ** 0.5)
    x = x.to(device=device, dtype=dtype)
    random_weight = (1 + 0.5 * torch.randn(match.width, generator=gen)).to(device=device, dtype=dtype)
    try:
        exact = not use_triton(x, weight)  # the torch reference runs the module's very ops
        for w in (weight, nn.Parameter(random_weight, requires_grad=False)):
            module._parameters[match.weight_name] = w
            with torch.no_grad():
                # the kernel itself, also where an eager call would run the original (few rows on CUDA)
                ref, got = original(x), plan_of(module, "norm").kernel(x, w)
            problem = _compare(got, ref, None if exact else _max_ulps(match, ref.dtype))
            if problem:
                return problem + ("" if w is weight else " (random weight)")
    except Exception as exc:  # noqa: BLE001 - any failure means: do not fuse
        return f"{type(exc).__name__}: {exc}"
    finally:
        module._parameters[match.weight_name] = weight
    return ""


def _max_ulps(match: NormMatch, dtype: torch.dtype) -> int:
    """How far apart (units in the last place of the output) Triton and torch may land on the same input.

    Only the mean of squares differs (reduction order, a few fp32 units), and every later step rounds alike:
    * 16-bit output, weight in fp32: one rounding, at the end, may flip: 1;
    * 16-bit output, cast then weight: the row cast back to the input dtype may flip by one unit, which moves
      the exact product ``weight * h`` by less than two units of the product, and the product's own rounding
      can add the third half: 2;
    * fp32 output: no 16-bit rounding hides the reduction order, which moves a few units: 16.
    """
    if dtype == torch.float32:
        return 16
    return 1 if match.weight_in_fp32 else 2


def _compare(got, ref, max_ulps: int | None) -> str:
    """'' when ``got`` equals ``ref`` (bitwise when ``max_ulps`` is None), else what differs."""
    if not isinstance(got, torch.Tensor) or not isinstance(ref, torch.Tensor):
        return "not a tensor"
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"{tuple(got.shape)} {got.dtype} vs {tuple(ref.shape)} {ref.dtype}"
    if max_ulps is None:
        differ = int((got != ref).sum())
        return f"{differ} of {ref.numel()} elements differ (the torch path must be bitwise equal)" if differ else ""
    worst = _ulps(got, ref)
    return f"{worst} units in the last place apart (at most {max_ulps} allowed)" if worst > max_ulps else ""


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between ``a`` and ``b`` in units in the last place of their (float) dtype."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    sign_clear = (1 << (8 * a.element_size() - 1)) - 1

    def ordered(t):  # float bit patterns mapped to integers in the order of the values (+0 == -0)
        i = t.contiguous().view(bits).to(torch.int64)
        return torch.where(i < 0, -(i & sign_clear), i)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0
