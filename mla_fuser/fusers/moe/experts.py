"""Decorated experts (``@use_experts_implementation``): the ``"mla_fuser"`` implementation and the per-block switch.

On import, ``"mla_fuser"`` is registered in Transformers' ``ExpertsInterface`` (``experts_implementation=
"mla_fuser"`` selects it too): ``fused_experts`` on the module's 3-D weights, or the implementation chosen
before wherever the kernel cannot run.  The decorator picks the implementation at call time from
``self.config._experts_implementation``, and that config is shared by the whole model, so ``apply_interface``
gives one experts instance a config *view* (``_ExpertsConfigView``) that names ``"mla_fuser"`` while the
model's own choice is unchanged since fusion; other blocks (declined ones included) keep theirs.  Generate's
decode-time swap to ``batched_mm`` is told apart from a user's choice by a flag that ``keep_fused_experts`` sets
(the runtime's ``generate`` enters it for models with ``switched_experts_views``): a ``context_flags.ContextFlag``,
which a forward compiled with ``fullgraph=True`` reads too.

Block-FP8 experts (float8 ``gate_up_proj``/``down_proj`` stacks with per-expert block scales, recognised by those
tensors: ``kernels.fp8.experts``) run ``fused_experts_fp8``.  Transformers gives its FP8 experts their own
``FP8ExpertsInterface`` (a registry apart from ``ExpertsInterface``), so ``"mla_fuser"`` is registered there too;
its own FP8 implementations fetch a kernel from the Hugging Face Hub, so FP8 experts never defer to them on a CPU.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from ... import compat
from ...context_flags import ContextFlag
from ...kernels.dispatch import requested_backend
from ...kernels.fp8.experts import FP8ExpertsLayout, explain_fp8_experts, fp8_expert_tensors
from ...kernels.fp8.format import FP8_DTYPE
from ..base import NoMatch
from .mlp import activation_name
from .specs import KERNEL_DTYPES, MoEMatch

IMPL_NAME = "mla_fuser"


# ---------------------------------------------------------------------------------------------------------
# recognising a decorated experts module

_DECORATED_CODE = None


def _decorated_forward_code():
    """Code object of the forward that ``@use_experts_implementation`` installs (the same for every class)."""
    global _DECORATED_CODE
    if _DECORATED_CODE is None:
        from transformers.integrations.moe import use_experts_implementation

        class _Probe(nn.Module):
            def forward(self, hidden_states, top_k_index, top_k_weights):  # pragma: no cover - never run
                return hidden_states

        _DECORATED_CODE = use_experts_implementation(_Probe).forward.__code__
    return _DECORATED_CODE


def interface_experts_dispatcher(module: nn.Module):
    """The ``ExpertsInterface`` a decorated experts module dispatches through, or None if not decorated."""
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or code is not _decorated_forward_code():
        return None
    cells = dict(zip(code.co_freevars, forward.__closure__ or ()))
    cell = cells.get("experts_interface")
    return cell.cell_contents if cell is not None else None


# ---------------------------------------------------------------------------------------------------------
# the per-instance switch, and generate's decode-time swap


class _ExpertsConfigView:
    """What one fused experts module reads as ``self.config``: the model's config, except that
    ``_experts_implementation`` says ``"mla_fuser"`` as long as the model's own choice is still the one it
    had when the block was fused.

    ``@use_experts_implementation`` picks the implementation at every call from
    ``self.config._experts_implementation``; that config object is shared by every experts module of the model,
    so setting it would switch blocks that were declined too.  The view switches this instance only, and a later
    ``model.set_experts_implementation(...)`` still wins.  Every other attribute (and every write) goes to the
    model's config.
    """

    def __init__(self, base):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_fused_over", compat.experts_implementation(base))
        object.__setattr__(self, "_base_id", id(base))  # (an int: what compiled code compares with the kept set)

    def __getattr__(self, name):
        if name in ("_base", "_fused_over", "_base_id") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._base, name)

    def __setattr__(self, name, value):
        setattr(self._base, name, value)

    @property
    def _experts_implementation(self):
        current = compat.experts_implementation(self._base)
        if current == self._fused_over:
            return IMPL_NAME
        if current == "batched_mm" and self._fused_over == "grouped_mm" and self._base_id in _DECODE_SWAP_KEPT.get():
            return IMPL_NAME  # generate()'s own decode-time swap, not a choice of the user (see keep_fused_experts)
        return current

    def __repr__(self):
        return f"_ExpertsConfigView({IMPL_NAME!r} over {self._fused_over!r} of {type(self._base).__name__})"


# Configs (by id) whose ``grouped_mm`` -> ``batched_mm`` switch is Transformers' ``generate`` swapping implementations
# for its decode steps (``_optimize_model_for_decode``) rather than a user's choice: fused experts stay fused there.
_DECODE_SWAP_KEPT = ContextFlag("decode_swap_kept", frozenset())


@contextlib.contextmanager
def keep_fused_experts(model: nn.Module, views: tuple | None = None):
    """Within the block, ``generate``'s decode-time switch from ``grouped_mm`` to ``batched_mm`` leaves this model's
    fused experts on the ``"mla_fuser"`` kernel (it would otherwise replace them with ``batched_mm`` for every
    decode step).  A model whose user chose another implementation before the call keeps that choice.  ``views``:
    the model's :func:`switched_experts_views`, when the caller keeps them (each call of ``generate`` enters this
    block, and walking every module costs host time that grows with the model)."""
    views = switched_experts_views(model) if views is None else views
    configs = {v._base_id for v in views
               if compat.experts_implementation(v._base) == v._fused_over == "grouped_mm"}
    with _DECODE_SWAP_KEPT.set_to(_DECODE_SWAP_KEPT.get() | configs):
        yield


def switched_experts_views(model: nn.Module) -> tuple:
    """The config views (``apply_interface``'s) through which experts modules of ``model`` read their
    implementation; empty when none does."""
    views = (m.__dict__.get("config") for m in model.modules())  # (what apply_interface set; no failing getattr)
    return tuple(v for v in views if isinstance(v, _ExpertsConfigView))


# ---------------------------------------------------------------------------------------------------------
# the registered implementation


_ACTIVATION_ATTR = "_mla_fuser_activation"


def _experts_activation(experts: nn.Module) -> str | None:
    """The experts' activation by what it computes, remembered on the module itself (a plain attribute, which
    torch.compile traces without guarding on a global cache)."""
    act = getattr(experts, "act_fn", None)
    cached = experts.__dict__.get(_ACTIVATION_ATTR)
    if cached is None or cached[0] is not act:
        cached = (act, activation_name(act) if act is not None else None)
        object.__setattr__(experts, _ACTIVATION_ATTR, cached)
    return cached[1]


def _previous_name(experts: nn.Module) -> str:
    """The implementation the model had chosen before fusion (``grouped_mm``, Transformers' default, when
    "mla_fuser" was asked for directly)."""
    config = getattr(experts, "config", None)
    name = config._fused_over if isinstance(config, _ExpertsConfigView) else None
    return "grouped_mm" if name in (None, IMPL_NAME) else name


def _previous_implementation(experts: nn.Module):
    """What runs when the kernel cannot: the implementation the model had chosen before fusion."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    registry = interface_experts_dispatcher(experts)  # (FP8 experts dispatch through their own registry)
    registry = ALL_EXPERTS_FUNCTIONS if registry is None else registry
    return registry.get(_previous_name(experts), inspect.unwrap(type(experts).forward))


# Token counts at which Transformers' own ``grouped_mm`` is faster on a CPU than the fused op's torch path there
# (``kernels.fused_moe.cpu``: one F.linear pair per picked expert, grouped on the host).  Measured on a 2-core CPU,
# fp32: the tiny preset's experts (8 of width 128, top-2) take 53 vs 114 us at 1 token and 110 vs 129 us at 2, but
# 225 vs 205 us at 4, 656 vs 462 at 64, 1237 vs 907 at 256; DeepSeek-V2-Lite's (64 of width 1408, top-6) 177 vs 163
# ms at 64 tokens, 342 vs 268 at 256, then 505 vs 563 ms at 1024 and 1.6 vs 2.3 s at 4096.  In between, a fused block
# whose model had chosen ``grouped_mm`` runs it (the native numerics, exactly); an explicit MLA_FUSER_BACKEND keeps
# the kernel's path.
CPU_GROUPED_MM_TOKENS = range(3, 1024)


def _defers_to_grouped_mm(experts: nn.Module, hidden: torch.Tensor) -> bool:
    """An eager CPU call whose size ``grouped_mm`` runs faster, in a model that had chosen it (compiled calls keep
    the op: one opaque node)."""
    return (not torch.compiler.is_compiling() and hidden.is_cpu and not _is_fp8(experts)
            and hidden.numel() // max(1, hidden.shape[-1]) in CPU_GROUPED_MM_TOKENS
            and requested_backend() is None and _previous_name(experts) == "grouped_mm")


_DEFAULT_GATE = []  # Transformers' default gate function, looked up once (asked at every experts call)


def _default_gate():
    if not _DEFAULT_GATE:
        _DEFAULT_GATE.append(compat.default_apply_gate())
    return _DEFAULT_GATE[0]


def _kernel_supports(experts: nn.Module, hidden: torch.Tensor, weights: torch.Tensor, gate_up=None) -> bool:
    if gate_up is None:
        gate_up = getattr(experts, "gate_up_proj", None)
    if not isinstance(gate_up, torch.Tensor) or gate_up.dtype not in KERNEL_DTYPES or gate_up.is_meta:
        return False
    if hidden.dtype not in KERNEL_DTYPES or hidden.device != gate_up.device:
        return False
    default_gate = _default_gate()
    if (getattr(experts, "has_gate", True) is not True or getattr(experts, "has_post_expert_norm", False)
            or getattr(experts, "_is_expert_parallel", False) or getattr(experts, "is_concatenated", True) is False
            or getattr(type(experts), "_apply_gate", default_gate) is not default_gate):
        return False
    if torch.is_grad_enabled() and (hidden.requires_grad or weights.requires_grad or gate_up.requires_grad):
        return False  # the kernel has no backward: training runs the previous implementation
    return _experts_activation(experts) is not None


def mla_fuser_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"mla_fuser"`` experts implementation: ``fused_experts`` on the module's 3-D weights.

    Same contract as Transformers' ``grouped_mm``/``batched_mm`` implementations (the decorator's flags on the
    instance give the layout; the default gate splits ``[gate; up]`` by halves).  What the kernel does not cover
    (no gate, post-expert norm, custom or ambiguous gating, expert parallelism, gradients, float64) runs the
    implementation chosen before, and so do CPU calls of a size where ``grouped_mm`` is faster there
    (``CPU_GROUPED_MM_TOKENS``).
    """
    from ...kernels.fused_moe import fused_experts

    gate_up = getattr(self, "gate_up_proj", None)  # (read once: each module attribute lookup is host time)
    if isinstance(gate_up, torch.Tensor) and gate_up.dtype == FP8_DTYPE:  # (_is_fp8)
        return _fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if not _kernel_supports(self, hidden_states, top_k_weights, gate_up) or _defers_to_grouped_mm(self, hidden_states):
        return _previous_implementation(self)(self, hidden_states, top_k_index, top_k_weights)
    down = self.down_proj
    if getattr(self, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    bias = getattr(self, "has_bias", False)
    return fused_experts(
        hidden_states, gate_up, down, top_k_index, top_k_weights,
        gate_up_bias=self.gate_up_proj_bias if bias else None, down_bias=self.down_proj_bias if bias else None,
        activation=self.__dict__[_ACTIVATION_ATTR][1],  # (what _kernel_supports just remembered)
    )


def register_experts_implementation() -> None:
    """Register ``"mla_fuser"`` in Transformers' ``ExpertsInterface`` (class-wide, every instance sees it), and in
    its FP8 experts' own registry (``FP8ExpertsInterface``: a subclass with a mapping of its own)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPL_NAME, mla_fuser_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # pragma: no cover - a Transformers without FP8 experts
        return
    FP8ExpertsInterface.register(IMPL_NAME, mla_fuser_experts_forward)


register_experts_implementation()


def apply_interface(module: nn.Module, match: MoEMatch) -> str:
    """Switch this block's experts module (only it) to ``"mla_fuser"``; says how, or raises ``NoMatch``."""
    return switch_experts(module.get_submodule(match.experts))


def switch_experts(experts: nn.Module) -> str:
    """Switch one decorated experts module to ``"mla_fuser"``; says how, or raises ``NoMatch``."""
    if isinstance(getattr(experts, "config", None), _ExpertsConfigView):
        return f"experts_implementation {IMPL_NAME!r} (already)"
    dispatcher = interface_experts_dispatcher(experts)
    if dispatcher is None or IMPL_NAME not in dispatcher:
        raise NoMatch("the experts dispatch through an interface without the 'mla_fuser' implementation")
    dtype = experts.gate_up_proj.dtype
    if dtype == FP8_DTYPE:
        layout, reason = explain_fp8_experts_module(experts)
        if layout is None:
            raise NoMatch(reason)
    elif dtype not in KERNEL_DTYPES:
        raise NoMatch(f"experts weights are {dtype}: the kernel takes float16, bfloat16 or float32")
    config = getattr(experts, "config", None)
    if config is None:
        raise NoMatch("the experts module has no config to select its implementation from")
    # imported at fusion, not inside the first forward (a first impression)
    from ...kernels import fused_moe  # noqa: F401

    # expert parallelism: each rank holds some of the experts, which the kernel does not take (_kernel_supports)
    parallel = ("; expert-parallel here: Transformers' own implementation runs them"
                if getattr(experts, "_is_expert_parallel", False) else "")
    _experts_activation(experts)  # found now: a forward compiled before any eager call cannot probe it (data-dependent)
    if compat.experts_implementation(config) == IMPL_NAME:
        return f"experts_implementation {IMPL_NAME!r} (selected by the model){parallel}"
    experts.config = _ExpertsConfigView(config)
    return f"experts module switched to experts_implementation {IMPL_NAME!r}{parallel}"


# ---------------------------------------------------------------------------------------------------------
# block-FP8 experts


_FP8_ATTR = "_mla_fuser_fp8_experts"
_GATE_ATTR = "_mla_fuser_default_gate"


def _is_fp8(experts: nn.Module) -> bool:
    gate_up = getattr(experts, "gate_up_proj", None)
    return isinstance(gate_up, torch.Tensor) and gate_up.dtype == FP8_DTYPE


def gate_is_default(experts: nn.Module) -> bool:
    """Whether the experts' ``_apply_gate`` computes Transformers' default ``act(gate) * up``: the default itself,
    or an override whose optional branches (softcaps, clamps, SwiGLU-OAI) are all off here -- told by running it
    on probes from 1e-3 to 1e4 in magnitude (a clamp or a softcap changes some of them).  Remembered on the module
    for its ``_apply_gate`` and activation."""
    default = compat.default_apply_gate()
    gate_fn = getattr(type(experts), "_apply_gate", default)
    if gate_fn is default:
        return True
    act = getattr(experts, "act_fn", None)
    cached = experts.__dict__.get(_GATE_ATTR)
    if cached is not None and cached[0] is gate_fn and cached[1] is act:
        return cached[2]
    magnitudes = torch.tensor([0.0, 1e-3, 0.1, 0.7, 1.0, 2.5, 6.0, 7.5, 10.0, 30.0, 100.0, 1e3, 1e4])
    values = torch.cat([magnitudes, -magnitudes[1:]])
    gate, up = torch.meshgrid(values, values, indexing="ij")
    probe = torch.cat([gate.reshape(-1, 1), up.reshape(-1, 1)], dim=1)
    try:
        with torch.no_grad():
            same = torch.allclose(gate_fn(experts, probe), default(experts, probe), rtol=1e-6, atol=0, equal_nan=True)
    except Exception:  # noqa: BLE001 - a gate we cannot probe is not the default one
        same = False
    object.__setattr__(experts, _GATE_ATTR, (gate_fn, act, same))
    return same


def explain_fp8_experts_module(experts: nn.Module) -> tuple[FP8ExpertsLayout | None, str]:
    """``(layout, "")`` when ``fused_experts_fp8`` computes what this experts module's contract says, else
    ``(None, reason)``: the stacks' format (``kernels.fp8.experts``) and the decorator's flags."""
    layout, reason = explain_fp8_experts(experts)
    if layout is None:
        return None, f"FP8 experts: {reason}"
    if getattr(experts, "has_gate", True) is not True or getattr(experts, "has_post_expert_norm", False):
        return None, "FP8 experts without gate or with a post-expert norm: not supported by the fused kernel"
    if getattr(experts, "is_concatenated", True) is False:
        return None, "FP8 experts with is_concatenated=False: not supported by the fused kernel"
    if not gate_is_default(experts):
        return None, "FP8 experts whose gating function (_apply_gate) is not act(gate) * up"
    if _experts_activation(experts) is None:
        return None, "FP8 experts activation is not silu, gelu, gelu_tanh or relu"
    return layout, ""


def _fp8_layout(experts: nn.Module) -> FP8ExpertsLayout | None:
    """The stacks' layout, remembered on the module for their shapes, dtypes and block size (what it depends on)."""
    tensors = fp8_expert_tensors(experts)
    block = getattr(experts, "block_size", None)
    key = (tuple((tuple(t.shape), t.dtype) if t is not None else None for t in tensors),
           tuple(block) if block is not None else None, getattr(experts, "act_fn", None))
    cached = experts.__dict__.get(_FP8_ATTR)
    if cached is None or cached[0] != key:
        cached = (key, explain_fp8_experts_module(experts)[0])
        object.__setattr__(experts, _FP8_ATTR, cached)
    return cached[1]


def _fp8_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """Block-FP8 experts on ``fused_experts_fp8``: Triton on CUDA, the torch reference on a CPU and while autograd
    records.  Stacks it cannot run (a changed format, expert parallelism) go to the implementation chosen before."""
    from ...kernels.fused_moe import fused_experts_fp8

    layout = _fp8_layout(self)
    if layout is None or getattr(self, "_is_expert_parallel", False) or self.gate_up_proj.is_meta:
        return _previous_implementation(self)(self, hidden_states, top_k_index, top_k_weights)
    gate_up, gate_up_scale, down, down_scale = fp8_expert_tensors(self)
    return fused_experts_fp8(
        hidden_states, gate_up, gate_up_scale, down, down_scale, top_k_index, top_k_weights,
        gate_up_block=layout.gate_up_block, down_block=layout.down_block, up_scale_base=layout.up_scale_base,
        up_row_shift=layout.up_row_shift, activation=_experts_activation(self),
    )
