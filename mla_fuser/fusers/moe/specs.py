"""What a match of an MoE block says: the routing, the MLPs' roles, the experts' layout.

Plain frozen records, at the bottom of the package: the router analysis builds them, ``MoEFuser`` returns them,
the experts switch and the ModuleList stacking read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what ``fused_experts`` takes


@dataclass(frozen=True)
class RouterSpec:
    """The routing computation, step by step as traced (paths are relative to the block).

    ``linear`` is an ``nn.Linear`` submodule (``linear_is_module``) or the path of a 2-D weight used with
    ``F.linear``.  ``*_dtypes`` are the casts found at each point, in order.  ``steps`` are the operations on
    the routing weights after selection, in order: ``("renorm", eps or None)``, ``("scale", c)``,
    ``("div", c)``, ``("cast", dtype)``.
    """

    linear: str
    linear_is_module: bool
    linear_bias: str | None
    input_flat: bool
    input_dtypes: tuple
    weight_dtypes: tuple
    router_dtype: torch.dtype | None
    logits_dtypes: tuple
    scoring: str  # "softmax" | "sigmoid"
    softmax_dtype: torch.dtype | None
    score_dtypes: tuple
    correction_bias: str | None
    correction_bias_dtypes: tuple
    n_group: int | None
    topk_group: int | None
    group_scoring: str | None  # "max" | "topn_sum"
    group_topn: int | None
    group_fill: float | None
    group_sorted: bool | None
    top_k: int
    sorted: bool
    weights_from: str  # "values" (top-k values of what was selected on) | "scores" | "choice" (gathered)
    steps: tuple

    @property
    def renormalize(self) -> bool:
        return any(op == "renorm" for op, _ in self.steps)

    @property
    def scaling(self) -> float:
        value = 1.0
        for op, arg in self.steps:
            value = value * arg if op == "scale" else value / arg if op == "div" else value
        return value

    def describe(self) -> str:
        parts = [f"{self.scoring} top-{self.top_k}"]
        if self.correction_bias:
            parts.append("correction bias")
        if self.n_group:
            parts.append(f"groups {self.topk_group}/{self.n_group} ({self.group_scoring})")
        if self.renormalize:
            parts.append("renormalised")
        if self.scaling != 1.0:
            parts.append(f"x{self.scaling:g}")
        if self.router_dtype is not None:
            parts.append(str(self.router_dtype).replace("torch.", ""))
        return ", ".join(parts)


@dataclass(frozen=True)
class MLPSpec:
    """Roles of a gated (``glu``: ``down(act(gate(x)) * up(x))``) or plain (``down(act(up(x)))``) MLP."""

    kind: str
    gate: str | None
    up: str
    down: str
    activation: str | None  # kernel name ("silu", "gelu", "gelu_tanh", "relu") or None when not one of those


@dataclass(frozen=True)
class SharedExpert:
    mlp: str
    kind: str  # "glu" | "plain"
    gate: str | None  # a 1-wide linear whose sigmoid multiplies the shared output
    flat: bool  # called on the flattened [T, H] hidden states (else on the block input as is)
    gate_flat: bool


@dataclass(frozen=True)
class MoEMatch:
    """A matched MoE block: roles as submodule names, sizes and the routing read from its graph."""

    router: RouterSpec
    experts: str  # the experts module (decorator kind) or the ModuleList
    experts_kind: str  # "interface" | "module_list"
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str
    interleaved: bool
    transposed: bool
    has_bias: bool
    expert_mlp: MLPSpec | None  # ModuleList items' roles
    shared: tuple  # SharedExpert, in the order they are added
    output_flat: bool
