"""What fusion leaves on the objects it changes, each reached through one helper.

* On a fused **module**: one plan per fuser kind (``plan_of(module, "mla")``), the object the run-time code of that
  kind needs (roles, sizes, the original forward).  One attribute name per kind, made here.
* On a fused **model**: one :class:`ModelState` (``model_state(model)``) with what the runtime layer keeps between
  calls (which layers are paged, whether ``generate`` was extended, graph diagnostics).

Low layer: imports nothing from the package.  Attributes are set with ``object.__setattr__`` so ``nn.Module`` never
registers them as submodules or parameters (they stay out of ``state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("mla", "moe", "mamba", "norm", "router", "mlp", "shared_overlap")
_PLAN_ATTRS = {kind: f"_mla_fuser_{kind}_plan" for kind in KINDS}
_STATE_ATTR = "_mla_fuser_state"


def plan_of(module, kind: str):
    """The ``kind`` plan fusion attached to ``module``, or None when that fuser did not fuse it."""
    return getattr(module, _PLAN_ATTRS[kind], None)


def set_plan(module, kind: str, plan) -> None:
    object.__setattr__(module, _PLAN_ATTRS[kind], plan)


@dataclass
class ModelState:
    """Per-model bookkeeping of fusion and the runtime layer."""

    fused: bool = False  # fuse() finished on this model (it is idempotent)
    paged_layers: tuple[int, ...] | None = None  # layer indices of the fused MLA modules, once fusion is done
    generate_extended: bool = False  # the runtime layer's generate is bound to this instance
    continuous_batching_extended: bool = False  # ... and its init_continuous_batching
    graphed_steps: int = 0  # decode steps of the last generate() replayed through a CUDA graph (diagnostics)
    graph_captures: int = 0  # how often that generate() captured its step
    kept_step: object = None  # the static cache and DecodeGraph kept for the next generate() (runtime.kept_steps)


def model_state(model) -> ModelState:
    """The model's :class:`ModelState`, created on first use."""
    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        state = ModelState()
        object.__setattr__(model, _STATE_ATTR, state)
    return state


def clear_plan(module, kind: str) -> None:
    module.__dict__.pop(_PLAN_ATTRS[kind], None)
