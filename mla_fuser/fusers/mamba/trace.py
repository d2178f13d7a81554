"""Tracing a candidate mixer: the cheap structural pre-filter's helpers and the meta trace the analysis reads.

The forward is traced (``graph.py``'s meta tracer) with two additions: helper modules created on the fly
(``ACT2FN[name](x)``) are traced through, and the mixer module's *kernel entry points* are single opaque nodes.
A kernel entry point is a function of the mixer's own module that wraps another function of that module
(transformers resolves each at import: hub kernel, else ``mamba_ssm`` / ``causal_conv1d``, else the in-file
torch reference).  So the graph is the same whichever implementation is installed.  The trace runs on a real
``[2, PROBE_LEN, width]`` input with an all-ones padding mask, so the places where the mixer zeroes padded
positions are seen.

Separate from the analysis because the fuser (signature, hidden-size candidates, training flag, probe input)
and the analysis (depthwise conv test, kernel entry points) both need these, and they need nothing else of the
package.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable

import torch
from torch import nn

from ... import graph as g

PROBE_LEN = 5  # tokens of the trace / probe input; unlike any feature width, so axes are never confused


def depthwise_conv(module) -> bool:
    return (
        isinstance(module, nn.Conv1d)
        and module.groups == module.in_channels == module.out_channels
        and module.weight.shape[1] == 1
    )


def forward_signature(module: nn.Module) -> inspect.Signature:
    sig = inspect.signature(inspect.unwrap(type(module).forward))
    params = list(sig.parameters.values())
    return sig.replace(parameters=params[1:]) if params and params[0].name == "self" else sig


def entry_function(value) -> Callable | None:
    """The function behind a global of a modeling file: ``value`` itself, or, for the callable modules Hugging Face's
    ``kernels`` package makes of decorated functions (Transformers 5.25 requires it), the function such a module
    calls: a function of the module's class's ``forward`` closure defined where the class says it was."""
    if inspect.isfunction(value):
        return value
    if isinstance(value, nn.Module) and not isinstance(value, type):
        cells = getattr(type(value).forward, "__closure__", None) or ()
        home = type(value).__module__
        found = [c.cell_contents for c in cells if inspect.isfunction(c.cell_contents)
                 and c.cell_contents.__module__ == home]
        return found[0] if len(found) == 1 else None
    return None


def kernel_entries(module: nn.Module) -> list[Callable]:
    """Globals of the mixer's own module that call a function wrapping another function of that module (kernel
    entry points: transformers resolves each at import, hub kernel, else ``mamba_ssm`` / ``causal_conv1d``, else the
    in-file torch reference).  A global whose function wraps nothing of the module (Transformers 5.25's
    ``causal_conv1d_forward`` / ``*_scan_forward``, which read the layer and its cache and call entry points) is no
    entry point: the trace goes through it."""
    forward = inspect.unwrap(type(module).forward)
    home = forward.__module__
    entries = []
    for name, value in forward.__globals__.items():
        function = None if name.startswith("_") or not callable(value) else entry_function(value)
        if (function is not None and function.__module__ == home
                and getattr(getattr(function, "__wrapped__", None), "__module__", None) == home):
            entries.append(value)
    return entries


def entry_signature(target) -> inspect.Signature:
    """The signature of a kernel entry point (the torch function's, through the wrappers)."""
    return inspect.signature(entry_function(target) or target)


@contextlib.contextmanager
def inference_mode_flag(module: nn.Module):
    """The mixer's own ``training`` flag off while it is traced / probed: the fused forward replaces the inference
    path (in training mode it runs the original), and a model built on the meta device is in training mode."""
    was = module.training
    module.training = False
    try:
        yield
    finally:
        module.training = was


def projection_weight(module) -> torch.Tensor:
    """A linear child's weight: the dtype/device of the activations (``A_log`` is often kept in fp32)."""
    return next(c.weight for c in module.children() if isinstance(c, nn.Linear))


def hidden_size_candidates(module, example_inputs) -> list[int]:
    if example_inputs is not None:
        args, kwargs = example_inputs
        first = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(first, torch.Tensor):
            return [int(first.shape[-1])]
    widths = [c.in_features for c in module.children() if isinstance(c, nn.Linear)]
    return sorted(set(widths), key=lambda w: (-widths.count(w), w))


def trace_mixer(module, params, width, mask_arg) -> g.TracedModule:
    """Trace on a real ``[2, L, width]`` input (every op also runs for real) with an all-ones mask."""
    weight = projection_weight(module)
    tracer = g.MetaTracer(module, opaque_functions=kernel_entries(module))
    gen = torch.Generator(device=weight.device if weight.device.type != "meta" else "cpu").manual_seed(0)
    hidden = torch.randn(2, PROBE_LEN, width, generator=gen, device=gen.device).to(weight.device, weight.dtype)
    tracer.placeholder_meta[params[0].name] = g.to_meta(hidden)
    if weight.device.type != "meta":
        tracer.placeholder_real[params[0].name] = hidden
    concrete = {}
    for p in params[1:]:
        if p.name == mask_arg:
            mask = torch.ones(2, PROBE_LEN, dtype=torch.long, device=weight.device)
            tracer.placeholder_meta[p.name] = g.to_meta(mask)
            if weight.device.type != "meta":
                tracer.placeholder_real[p.name] = mask
        elif p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):  # (empty: the tracer passes none)
            continue
        elif p.default is not inspect.Parameter.empty:
            concrete[p.name] = p.default
        else:
            raise g.TraceError(f"no value for forward argument {p.name!r}")
    return g.run_trace(module, tracer, concrete, params[0].name, width)
