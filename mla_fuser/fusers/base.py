"""What every fuser shares: the match cache keyed by (class, parameter shapes), input capture, the report.

A fuser has two steps.  ``match(module)`` looks at one module by structure and returns a match object (roles
as submodule names, plus the sizes it inferred) or None.  ``apply(module, match)`` changes that one instance
(never its class) and returns a ``FusionRow``.  Matches are cached per class *and* parameter shapes: the
same class with and without q-LoRA is two entries, and a 60-layer model traces each distinct entry once.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ..graph import TRACE_LOCK, TraceError, trace_module


def shape_key(module: nn.Module, example_inputs=None) -> tuple:
    """Cache key: the class plus every parameter's name and shape (plus the input layout, when known)."""
    params = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    layout = None
    if example_inputs is not None:
        args, kwargs = example_inputs
        layout = (_layout(args), tuple(sorted((k, _layout(v)) for k, v in kwargs.items())))
    return (type(module), params, layout)


def _layout(value):
    if isinstance(value, torch.Tensor):
        return ("T", value.ndim, str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_layout(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value).__name__
    return type(value).__name__


@dataclass
class FusionRow:
    """One candidate module in the report."""

    qualname: str
    cls: str
    fuser: str
    status: str  # "fused" | "fallback"
    reason: str = ""


@dataclass
class FusionReport:
    """What ``fuse`` did to a model: one row per candidate module, plus model-wide notes."""

    rows: list[FusionRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fused(self, fuser: str | None = None) -> list[FusionRow]:
        return [r for r in self.rows if r.status == "fused" and (fuser is None or r.fuser == fuser)]

    def fallbacks(self, fuser: str | None = None) -> list[FusionRow]:
        return [r for r in self.rows if r.status == "fallback" and (fuser is None or r.fuser == fuser)]

    def __str__(self) -> str:
        lines = []
        if self.rows:
            headers = ("module", "class", "fuser", "status", "reason")
            table = [(r.qualname, r.cls, r.fuser, r.status, r.reason) for r in self.rows]
            widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers[:-1])]
            fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
            lines.append(fmt.format(*headers))
            lines.append(fmt.format(*("-" * w for w in widths), "-" * 6))
            lines.extend(fmt.format(*row) for row in table)
        else:
            lines.append("no candidate modules found")
        counts = {}
        for r in self.rows:
            counts[(r.fuser, r.status)] = counts.get((r.fuser, r.status), 0) + 1
        if counts:
            lines.append("summary: " + ", ".join(f"{f} {s}: {n}" for (f, s), n in sorted(counts.items())))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"FusionReport({len(self.fused())} fused, {len(self.fallbacks())} fallback)"


class NoMatch(Exception):
    """Raised inside matchers to decline with a reason (the reason ends up in the report)."""


class Fuser:
    """Base class: subclasses implement ``_match`` (may raise ``NoMatch``) and ``apply``."""

    name = "base"
    _cache: dict = {}

    @classmethod
    def match(cls, module: nn.Module, example_inputs=None):
        """The match for ``module`` or None; see ``explain`` for the reason of a None."""
        result, _ = cls.explain(module, example_inputs)
        return result

    @classmethod
    def explain(cls, module: nn.Module, example_inputs=None):
        """``(match, reason)``: the match or None, and why not when None."""
        key = (cls, cls.cache_key(module, example_inputs))
        cache = Fuser._cache
        with TRACE_LOCK:  # one trace at a time in the process, and the cache filled once per key
            if key not in cache:
                try:
                    cache[key] = (cls._match(module, example_inputs), "")
                except NoMatch as exc:
                    cache[key] = (None, str(exc))
                except TraceError as exc:
                    cache[key] = (None, f"trace failed: {exc}")
            return cache[key]

    @classmethod
    def candidate_names(cls, model: nn.Module) -> list[str]:
        """The qualified names of ``model``'s submodules worth matching (``is_candidate``); a family that also
        judges a module by where it sits narrows this (the gated-MLP fuser leaves a ModuleList's experts out)."""
        return [n for n, m in model.named_modules() if n and cls.is_candidate(m)]

    @classmethod
    def cache_key(cls, module: nn.Module, example_inputs=None) -> tuple:
        """What decides a match: class and parameter shapes (and input layout); families whose structure also
        depends on plain attributes extend it."""
        return shape_key(module, example_inputs)

    @classmethod
    def _match(cls, module: nn.Module, example_inputs=None):  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def trace(cls, module: nn.Module, example_inputs=None, hidden_size: int | None = None):
        return trace_module(module, hidden_size=hidden_size, example_inputs=example_inputs)

    @staticmethod
    def cache_clear() -> None:
        Fuser._cache.clear()

    @staticmethod
    def cache_size() -> int:
        return len(Fuser._cache)


def common_input_width(module: nn.Module) -> int | None:
    """Most common ``in_features`` among the module's direct linear children (its hidden size), or None."""
    counts: dict[int, int] = {}
    for child in module.children():
        if isinstance(child, nn.Linear):
            counts[child.in_features] = counts.get(child.in_features, 0) + 1
    if not counts:
        return None
    best = max(counts.values())
    winners = [w for w, c in counts.items() if c == best]
    return winners[0] if len(winners) == 1 else None


# ---------------------------------------------------------------------------------------------------------
# instance forwards


def bind_instance_forward(module: nn.Module, fused, wrap_own: bool = False) -> tuple:
    """Bind ``fused`` (a function of ``(self, ...)``) as the forward of this *instance* (never its class).

    Under an accelerate hook (``device_map`` dispatch, offload) what the hook wraps (``_old_forward``) is replaced, so
    the hook keeps running around the fused forward and ``remove_hook_from_module`` restores it.  Returns
    ``(original, "")``, the bound forward it replaced, or ``(None, reason)`` when the instance already has a forward
    of its own (someone else's binding: not ours to wrap), unless ``wrap_own`` (the Mamba mixers' fused forward
    calls whatever forward the instance had)."""
    hooked = getattr(module, "_hf_hook", None) is not None and "_old_forward" in module.__dict__
    if hooked:
        original = module._old_forward
    elif "forward" in module.__dict__:
        if not wrap_own:
            return None, "the instance already has its own forward"
        original = module.__dict__["forward"]
    else:
        original = types.MethodType(type(module).forward, module)
    module.__dict__["_old_forward" if hooked else "forward"] = types.MethodType(fused, module)
    return original, ""


def unbind_instance_forward(module: nn.Module, original) -> None:
    """Undo :func:`bind_instance_forward` (``original`` is what it returned)."""
    if getattr(module, "_hf_hook", None) is not None and "_old_forward" in module.__dict__:
        module.__dict__["_old_forward"] = original
    elif getattr(original, "__self__", None) is module and original.__func__ is type(module).forward:
        module.__dict__.pop("forward", None)  # the class's own: no instance forward, as before
    else:
        module.__dict__["forward"] = original
