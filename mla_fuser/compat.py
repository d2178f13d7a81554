"""Transformers touch points: the names we register and the version-dependent or private attributes we read.

Low layer: imports nothing from the package.  Code elsewhere asks these helpers instead of reading Transformers'
private names itself, so a rename between releases is mended here once.
"""

from __future__ import annotations

import contextlib

# the attention implementation we register in Transformers' AttentionInterface / AttentionMaskInterface
ATTENTION_NAME = "vllm_mla"


def attention_implementation(module) -> str | None:
    """The attention implementation ``module``'s config names now (``set_attn_implementation`` and assignments to
    ``config._attn_implementation`` change it at run time), or None when the module has no config."""
    config = getattr(module, "config", None)
    return None if config is None else getattr(config, "_attn_implementation", None)


# What each feature needs of Transformers (first release where it works; checked by running the test suite on the
# releases named).  The package as a whole supports >=5.17,<6 (``SUPPORTED``); the README's table repeats this.
SUPPORTED = ((5, 17), (6, 0))
FEATURE_MIN_VERSION = {
    "mla": (5, 17),
    "moe": (5, 17),
    "norm": (5, 17),
    # the mixers keep their states through Cache.get_conv_state / get_recurrent_state, first in 5.21
    "mamba": (5, 21),
    # the continuous-batching engine's cache API update(key, value, layer_idx, kwargs), first in 5.19
    "continuous batching": (5, 19),
    # `mla-fuser serve`: Transformers' own server (transformers.cli.serving) over continuous batching, hence 5.19
    "serve": (5, 19),
}
MAMBA_CACHE_METHODS = ("get_conv_state", "get_recurrent_state", "update_conv_state", "update_recurrent_state")


def transformers_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed Transformers."""
    import transformers

    parts = []
    for piece in transformers.__version__.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def missing_mamba_cache_methods() -> list[str]:
    """The cache methods Mamba fusion needs that the installed ``Cache`` lacks (all present from 5.21)."""
    from transformers.cache_utils import Cache

    return [m for m in MAMBA_CACHE_METHODS if not hasattr(Cache, m)]


def disabled_features() -> dict[str, str]:
    """Feature -> why the installed Transformers disables it (empty when every feature works)."""
    import transformers

    out = {}
    missing = missing_mamba_cache_methods()
    if missing:
        low = ".".join(map(str, FEATURE_MIN_VERSION["mamba"]))
        out["mamba"] = (f"transformers {transformers.__version__} is older than Mamba fusion needs (>={low}: its Cache "
                        f"lacks {missing}); Mamba mixers run unfused")
    return out


# a forward's cache argument: ``cache`` (Transformers 5.2x), ``past_key_values`` (older, and most models' generate
# keyword), ``cache_params`` (Mamba models before the rename)
CACHE_KWARGS = ("cache", "past_key_values", "cache_params")


def cache_keyword(model) -> str:
    """The name under which ``model.forward`` takes its cache (see ``CACHE_KWARGS``)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    for name in CACHE_KWARGS:
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes no cache argument")


def caller_chose_cache(model, kwargs) -> bool:
    """Whether a ``generate`` call settles its own cache: a cache passed under any of ``CACHE_KWARGS``, a
    ``cache_implementation`` (argument or generation config), or ``use_cache=False``.  The one definition the
    runtime layer uses before it chooses a cache of its own."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if any(kwargs.get(name) is not None for name in CACHE_KWARGS):
        return True
    if kwargs.get("cache_implementation", getattr(config, "cache_implementation", None)) is not None:
        return True
    return kwargs.get("use_cache", getattr(config, "use_cache", True)) is False


def experts_implementation(config) -> str | None:
    """The experts implementation a config names (``@use_experts_implementation`` reads it at every call)."""
    return getattr(config, "_experts_implementation", None)


def default_apply_gate():
    """Transformers' own gate application of decorated experts; a class that overrides it computes something else."""
    from transformers.integrations.moe import _default_apply_gate

    return _default_apply_gate


def tensor_parallel_hooked(module) -> bool:
    """Whether a Transformers tensor-parallel style wraps ``module``'s forward (its backward all-reduces)."""
    return bool(getattr(module, "_is_hooked", False))


@contextlib.contextmanager
def attention_implementation_set(config, name: str):
    """Within the block ``config`` names ``name`` as its attention implementation, written to the private field
    behind ``config._attn_implementation`` (the public setter validates names and would refuse a tracing-only one);
    the previous value is put back whatever happens.  A config without that field is left alone."""
    if config is None or not hasattr(config, "_attn_implementation_internal"):
        yield
        return
    previous = config.__dict__.get("_attn_implementation_internal")
    config.__dict__["_attn_implementation_internal"] = name
    try:
        yield
    finally:
        config.__dict__["_attn_implementation_internal"] = previous


# ---- continuous batching: the engine's cache allocators ---------------------------------------------------------
# Up to 5.24 every full-attention layer group of CB's pool is a ``FullAttentionCacheAllocator``: a token's row is a K
# half and a V half (``num_key_value_heads x head_dim`` each) in two pages of a block.  From 5.25 a config with
# ``kv_lora_rank`` gets an ``MLACacheAllocator`` instead: one row of ``kv_lora_rank + qk_rope_head_dim`` values per
# token and layer, written as two column ranges (``[:kv_lora_rank]`` and the rest), with no block-table page views.


def cb_latent_allocator(allocator) -> bool:
    """Whether ``allocator`` (one layer group of CB's pool) holds one latent row per token (5.25's
    ``MLACacheAllocator``) rather than K / V half rows."""
    try:
        from transformers.generation.continuous_batching.cache_allocators import MLACacheAllocator
    except ImportError:  # (before 5.25)
        return False
    return isinstance(allocator, MLACacheAllocator)


def cb_latent_row_layout(allocator) -> tuple[int, int]:
    """``(cut, width)`` of a latent allocator's rows: the engine writes its update's key into columns ``[:cut]`` and
    its value into ``[cut:width]``."""
    return allocator.kv_lora_rank, allocator.row_numel


def cb_latent_rows(allocator, layer_idx: int):
    """``[slots, width]``: the rows of one layer of a latent allocator, the view the engine's read / write indices
    address (its private per-layer views start at the layer's page within each block, as this one does); None for
    an allocator that is not a latent one."""
    if not cb_latent_allocator(allocator):
        return None
    rows = allocator.cache_tensor[allocator.layer_indices.index(layer_idx) * allocator.tokens_per_page:]
    private = getattr(allocator, "_latent_token_views", {}).get(layer_idx)
    if private is not None and private[0].data_ptr() != rows.data_ptr():
        raise RuntimeError(f"continuous batching: the engine's layer {layer_idx} rows moved in this Transformers "
                           f"release; mla_fuser.compat.cb_latent_rows needs updating")
    return rows


# ---- `mla-fuser serve`: Transformers' server pieces (transformers.cli.serving) ------------------------------------
# 5.19 to 5.24: an in-process server (``serve.app``).  Its constructors grew keywords release by release
# (ModelManager(continuous_batching=) in 5.23, build_server(systemone_handler=) in 5.21): the serve layer offers every
# keyword it can fill and keeps those the installed release takes, so no release check is spread over the code.
# 5.25 rebuilt that server (``serve.engine``): each model runs in a spawned process of its own (``EngineClient``),
# which loads it with a copy of the server's ``ModelLoader`` (pickled); ``TimedModel`` and the in-process generation
# managers are gone.  What the serve layer uses there: a ``ModelLoader`` subclass (our model, fused, in the engine
# process; config and tokenizer of a preset in the API server), ``ModelManager.preload_engine`` (the pinned model's
# ``EngineClient``, a subclass capping new tokens at the context), the handlers' ``_check_prompt_length`` (our
# message), and Transformers' own client-disconnect cancelling, plain ASGI request-id middleware, per-stream SSE
# templates and per-request log lines (``set_serve_log_level``), which replace ours from that release on.
SERVE_REBUILT = (5, 25)
SERVING_OPTIONAL_HANDLERS = {"systemone_handler": ("systemone", "SystemOneHandler")}  # keyword -> (module, class)


def accepted_keywords(fn, kwargs: dict) -> dict:
    """The entries of ``kwargs`` that ``fn``'s signature names (all of them when it takes ``**kwargs``)."""
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def serving_optional_handlers() -> dict[str, type]:
    """``build_server`` keyword -> handler class, for the optional endpoints the installed Transformers has."""
    import importlib

    out = {}
    for keyword, (module, name) in SERVING_OPTIONAL_HANDLERS.items():
        try:
            out[keyword] = getattr(importlib.import_module(f"transformers.cli.serving.{module}"), name)
        except (ImportError, AttributeError):
            continue
    return out


def serving_engine(generate_manager):
    """The continuous-batching manager behind Transformers' serving ``CBGenerateManager`` (its private ``_cb``; None
    before the first request), which the serve layer needs to cancel a request whose HTTP client went away."""
    return getattr(generate_manager, "_cb", None)


def serving_in_engine_processes() -> bool:
    """Whether the installed Transformers' server runs each model in an engine process of its own (5.25 on), which
    ``serve.engine`` drives, rather than in the server's process (``serve.app``)."""
    return transformers_version() >= SERVE_REBUILT


def serving_log_requests(level: int) -> None:
    """Transformers' serve messages at ``level``, with its line per request (``Request <id>: model ...``; from 5.25,
    where it is off unless asked; before, every handler logged ``[Request received]`` at warning anyway)."""
    from transformers.cli.serving.utils import set_serve_log_level

    set_serve_log_level(level, log_requests=True)
