"""Every environment variable mla-fuser reads, parsed in one place with one vocabulary.

The library reads these (at each use, so a test or a user may change them between calls) and never writes
them.  A value outside a variable's vocabulary is an error that names the allowed values: a typo such as
``MLA_FUSER_BACKEND=cuda`` or ``VLLM_MLA_DISABLE=maybe`` must never be read silently as something else.

Switches share one vocabulary: ``1 true yes on`` mean on, ``0 false no off`` (or unset / empty) mean off,
case-insensitive.  ``check_all()`` validates every variable at once; ``fuse()`` calls it, so a bad value fails
when the model is loaded, not at its first forward.  ``README.md`` lists the same variables (a test checks
that the table and ``VARIABLES`` agree).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class SettingError(ValueError):
    """An environment variable holds a value outside its vocabulary."""


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str  # "switch" | "choice" | "int" | "path"
    default: object
    doc: str
    choices: tuple[str, ...] = ()


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("VLLM_MLA_DISABLE", "switch", False,
             "no MLA fusion; `vllm_mla` runs padded full attention; one warning; the report says why"),
    Variable("MLA_FUSER_BACKEND", "choice", None,
             "force the kernel backend (default: Triton on CUDA, torch on CPU); with `TRITON_INTERPRET=1`, "
             "`triton` runs the Triton kernels on CPU", choices=("triton", "torch")),
    Variable("MLA_FUSER_CUDA_GRAPHS", "switch", True,
             "`0` makes `generate()` of a fused model run its decode steps eagerly instead of replaying them "
             "from a CUDA graph"),
    Variable("MLA_FUSER_REUSE_DECODE_GRAPHS", "switch", True,
             "`0` makes every graphed `generate()` call build its own static cache and capture its own decode step, "
             "instead of taking back the last call's (same batch, cache size and padding, model unchanged)"),
    Variable("MLA_FUSER_STEP_AHEAD", "switch", True,
             "`0` makes a graphed single-beam greedy or sampling `generate()` launch each decode step's replay when "
             "Transformers' loop calls the forward, instead of as soon as the step's input token is chosen (on a side "
             "stream, while the host prepares the step; `runtime/step_ahead.py`)"),
    Variable("MLA_FUSER_MOE_SMALL_BATCH_TOKENS", "int", None,
             "tokens up to which the fused MoE kernel takes its small-batch (expert-grouped) path (default 16; 4 for "
             "block-FP8 experts)"),
    Variable("MLA_FUSER_MOE_GEMV_TOKENS", "int", None,
             "tokens up to which the small-batch MoE path runs decode GEMVs (default 4): the down projection fused "
             "with the top-k sum, and the gate/up projection where the tuned tile table has a tile for it "
             "(block-FP8 experts: always)"),
    Variable("MLA_FUSER_MOE_CONFIGS", "path", None,
             "JSON of tuned MoE tiles (the `best_configs` format `benchmarks/bench_fused_moe.py` writes)"),
    Variable("MLA_FUSER_DECODE_TILES", "path", None,
             "JSON of tuned MLA decode tiles per latent shape (the table `benchmarks/tune_mla_decode.py` writes), "
             "instead of the one shipped for Hopper"),
    Variable("MLA_FUSER_DECODE_TMA", "switch", True,
             "`0` runs the paged MLA decode at up to 16 heads on Hopper on its kernel with tiles from pointers "
             "(`kernels/mla_decode.py`) instead of the one reading the latent tiles by TMA "
             "(`kernels/mla_decode_tma.py`: 2-10% faster per call on an H100)"),
    Variable("MLA_FUSER_OVERLAP_SHARED_EXPERTS", "switch", True,
             "`0` keeps an MoE block's shared experts on the block's own CUDA stream in captured (CUDA-graph) steps "
             "instead of running them on a second stream beside the routed experts"),
    Variable("MLA_FUSER_DIRECT_LAUNCH", "switch", True,
             "`0` launches compiled Triton kernels through Triton's own `JITFunction.run` every time instead of "
             "straight through the kernel Triton compiled for the call's specialisation (less host time per launch)"),
    Variable("MLA_FUSER_FP8_ACT_QUANT", "switch", True,
             "`0` keeps block-FP8 layers weight-only at every batch size: activations are never quantised to e4m3 "
             "(the linear's W8A8 and tensor-core paths and the FP8 experts' W8A8 GEMMs from 3 tokens are off; slower, "
             "a little more accurate)"),
    Variable("MLA_FUSER_SPLITK_FIXUP", "switch", True,
             "`0` sums the split-K partials of the block-FP8 split-K GEMM in a second launch instead of in the last "
             "split of each output tile (the same result; one launch more per split GEMM)"),
    Variable("MLA_FUSER_ROUTER_LOGITS_KERNEL", "switch", True,
             "`0` computes a fused MoE router's logits with torch (fp32 copies of the hidden states and the gate, "
             "cuBLAS) at every size, instead of in one launch of a logits kernel (decode steps' few rows, "
             "continuous-batching and prefill steps' hundreds of 16-bit rows)"),
    Variable("MLA_FUSER_SKINNY_LINEAR", "switch", False,
             "`1` (experimental; on an H100 no faster over a whole decode step, `kernels/skinny_linear.py`) runs "
             "the dense linears of captured (CUDA-graph) decode steps (the stacked q + kv and gate + up projections, "
             "`o_proj`, a gated MLP's down projection, absorbed MLA's per-head W_UK and W_UV products) on a Triton "
             "GEMM that reads their weights at up to 16 rows with more programs; off keeps cuBLAS"),
    Variable("TRITON_INTERPRET", "switch", False,
             "Triton's own flag: run Triton kernels in its interpreter (how the tests run them on CPU)"),
)}


_ENCODED: dict[str, object] = {}  # variable name -> its key in os.environ's own storage


def _raw(name: str) -> str:
    # What ``os.environ.get(name, "")`` returns, read from the mapping's own storage: ``get`` encodes the key and
    # raises and catches a KeyError for an unset variable, ~0.6 us, and a backend check reads a variable for every op
    # of an eager step (a few dozen per decode step of a small model on a CPU).  Any other mapping: its ``get``.
    environ = os.environ
    data = getattr(environ, "_data", None)
    if type(data) is not dict or not hasattr(environ, "encodekey"):
        return environ.get(name, "").strip()
    key = _ENCODED.get(name)
    if key is None:
        key = _ENCODED[name] = environ.encodekey(name)
    value = data.get(key)
    return "" if value is None else environ.decodevalue(value).strip()


def _allowed(var: Variable) -> str:
    if var.kind == "switch":
        return "one of " + ", ".join(TRUE_WORDS + FALSE_WORDS) + " (or unset)"
    if var.kind == "choice":
        return "one of " + ", ".join(var.choices) + " (or unset)"
    if var.kind == "int":
        return "a non-negative integer (or unset)"
    return "a path to an existing file (or unset)"


def get(name: str):
    """The parsed value of ``name`` (its default when unset or empty); ``SettingError`` for a bad value."""
    var = VARIABLES[name]
    raw = _raw(name)
    if not raw:
        return var.default
    word = raw.lower()
    if var.kind == "switch":
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    elif var.kind == "choice":
        if word in var.choices:
            return word
    elif var.kind == "int":
        if word.isdigit():
            return int(word)
    elif var.kind == "path":
        if os.path.isfile(raw):
            return raw
    raise SettingError(f"{name}={raw!r} is not valid: expected {_allowed(var)}")


def check_all() -> None:
    """Parse every variable; the first bad one raises ``SettingError``."""
    for name in VARIABLES:
        get(name)


def describe(name: str) -> str:
    """``NAME=value`` as set in the environment (for reports)."""
    return f"{name}={_raw(name)}"


# ---- the accessors the package uses


def mla_disabled() -> bool:
    return bool(get("VLLM_MLA_DISABLE"))


def kernel_backend() -> str | None:
    """``"triton"``, ``"torch"`` or None (automatic)."""
    return get("MLA_FUSER_BACKEND")


def cuda_graphs_enabled() -> bool:
    return bool(get("MLA_FUSER_CUDA_GRAPHS"))


def reuse_decode_graphs() -> bool:
    return bool(get("MLA_FUSER_REUSE_DECODE_GRAPHS"))


def step_ahead() -> bool:
    return bool(get("MLA_FUSER_STEP_AHEAD"))


def triton_interpreting() -> bool:
    return bool(get("TRITON_INTERPRET"))


def moe_small_batch_tokens(default: int) -> int:
    value = get("MLA_FUSER_MOE_SMALL_BATCH_TOKENS")
    return default if value is None else value


def moe_gemv_tokens(default: int) -> int:
    value = get("MLA_FUSER_MOE_GEMV_TOKENS")
    return default if value is None else value


def fp8_act_quant() -> bool:
    return bool(get("MLA_FUSER_FP8_ACT_QUANT"))


def splitk_fixup() -> bool:
    return bool(get("MLA_FUSER_SPLITK_FIXUP"))


def skinny_linear() -> bool:
    return bool(get("MLA_FUSER_SKINNY_LINEAR"))


def decode_tma() -> bool:
    return bool(get("MLA_FUSER_DECODE_TMA"))


def router_logits_kernel() -> bool:
    return bool(get("MLA_FUSER_ROUTER_LOGITS_KERNEL"))


def moe_configs_path() -> str | None:
    return get("MLA_FUSER_MOE_CONFIGS")


def decode_tiles_path() -> str | None:
    return get("MLA_FUSER_DECODE_TILES")
