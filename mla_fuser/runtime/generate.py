"""The runtime layer's ``generate``: one wrapper, bound to a fused model instance, that decides in one place

* the **cache**: a fused MLA model (using ``vllm_mla``) whose caller settles no cache (``compat.caller_chose_cache``)
  gets a ``PagedLatentCache``;
* the **graph plan**: on CUDA, a single-beam call that is unpadded or left-padded with enough new tokens replays its
  decode steps from a CUDA graph (:class:`GraphedForward` over a static paged cache, or over Transformers' own cache
  of a Mamba model whose layers all keep fixed-size states); ``MLA_FUSER_CUDA_GRAPHS=0`` turns that off;
* the **experts implementation**: experts the MoE fuser switched stay on the fused kernel through ``generate``'s
  decode-time swap to ``batched_mm`` (``fusers.moe.keep_fused_experts``); a user's own choice still wins.

The class and Transformers stay untouched; anything the caller chose (a cache, ``cache_implementation``,
``use_cache=False``, beams, an assistant) is passed through as given.
"""

from __future__ import annotations

import contextlib
import inspect
import types

import torch

from .. import envs
from ..attention_interfaces.vllm_mla import left_padding_of
from ..cache import PagedLatentCache, paged_layer_indices
from ..compat import ATTENTION_NAME, attention_implementation, cache_keyword, caller_chose_cache
from ..fusers.moe.experts import has_switched_experts, keep_fused_experts
from ..plans import model_state
from .decode_graph import DecodeGraph

# Fewer new tokens than this do not repay the capture (about one eager step plus instantiation).
GENERATE_MIN_NEW_TOKENS = 8


def extend_generate(model) -> list[str]:
    """Bind the runtime layer's ``generate`` to ``model`` (once); returns report notes saying what it does, empty
    when there is nothing to do (no fused MLA layer, no graph-capable Mamba cache, no switched experts)."""
    state = model_state(model)
    if state.generate_extended or not hasattr(model, "generate"):
        return []
    paged = bool(paged_layer_indices(model))
    states_only = not paged and _graphs_over_own_cache(model)
    experts = has_switched_experts(model)
    notes = []
    if paged:
        notes.append("generate() uses a paged latent cache unless another cache is requested")
    if states_only:
        notes.append("generate() replays decode steps from a CUDA graph on CUDA (states only cache)")
    if experts:
        notes.append("generate() keeps the fused experts for its decode steps (no batched_mm swap)")
    if not notes:
        return []
    inner = model.generate
    keyword = cache_keyword(model)

    def generate(self, *args, **kwargs):
        with keep_fused_experts(self) if experts else contextlib.nullcontext():
            cache, graphed = _plan(self, args, kwargs, paged, states_only)
            if cache is None:
                return inner(*args, **kwargs)
            kwargs[keyword] = cache
            if not graphed:
                return inner(*args, **kwargs)
            return generate_graphed(self, inner, cache, args, kwargs)

    model.generate = types.MethodType(generate, model)
    state.generate_extended = True
    return notes


def _plan(model, args, kwargs, paged: bool, states_only: bool):
    """``(cache, graphed)``: the cache this call gets from us (None: the caller's or Transformers' choice stands)
    and whether its decode steps replay a CUDA graph."""
    if caller_chose_cache(model, kwargs):
        return None, False
    if paged:
        if attention_implementation(model) != ATTENTION_NAME:
            return None, False  # switched away after fusion: the class's forward expands K/V as Transformers does
        shape = graphed_generate_plan(model, args, kwargs)
        if shape is None:
            return PagedLatentCache(model), False
        batch, max_seq_len, starts = shape  # a static cache this size; left-padded rows' padding is skipped
        cache = PagedLatentCache.static_for(model, batch, max_seq_len)
        cache.set_left_padding(starts)
        return cache, True
    if states_only and graphed_generate_plan(model, args, kwargs) is not None:
        from transformers import DynamicCache

        return DynamicCache(config=model.config), True  # (padding does not matter to a state-only step)
    return None, False


def _graphs_over_own_cache(model) -> bool:
    """Whether every layer of the model's own default cache keeps fixed-size states (a fused Mamba model), so its
    decode steps can replay a graph over Transformers' cache."""
    from transformers import DynamicCache

    try:
        DecodeGraph(model, DynamicCache(config=model.config), capture=False)
    except (ValueError, TypeError):
        return False
    return True


def generate_graphed(model, inner, cache, args, kwargs):
    """``inner(*args, **kwargs)`` with the decode steps over ``cache`` replayed from a CUDA graph; how many steps
    were replayed and how often the step was captured are kept in the model's state for diagnostics."""
    with GraphedForward(model, cache) as graphed:
        out = inner(*args, **kwargs)
    state = model_state(model)
    state.graphed_steps, state.graph_captures = graphed.steps, graphed.graph.captures
    return out


def cuda_graphs_wanted() -> bool:
    """``MLA_FUSER_CUDA_GRAPHS=0`` turns the graphed decode of ``generate`` off."""
    return envs.cuda_graphs_enabled()


class GraphedForward:
    """A forward for one ``generate`` call: decode steps over ``cache`` replay a :class:`DecodeGraph`, every other
    call (the prefill, anything with inputs the graph does not take) runs the model's own forward.

    Bound to the model instance for the duration of the call (``with GraphedForward(model, cache):``); the
    output of a replayed step has the type and cache field of the model's own output, with last-token logits."""

    _PASSED_THROUGH = ("labels", "output_attentions", "output_hidden_states")

    def __init__(self, model, cache):
        self.model = model
        self.cache = cache
        self.keyword = cache_keyword(model)
        self.graph = DecodeGraph(model, cache)
        self.output_type = None
        self.cache_field = None  # the output's cache field, read off the first eager output (_cache_field)
        self.steps = 0  # decode steps that went through the graph (the first one runs eagerly inside it)
        self._inside = False  # the graph's own eager step and capture call the model: those run the original

    def __enter__(self):
        self.previous = self.model.__dict__.get("forward")
        self.original = self.model.forward
        self.model.forward = self
        return self

    def __exit__(self, *exc):
        if self.previous is None:
            del self.model.__dict__["forward"]
        else:
            self.model.forward = self.previous
        return False

    @property
    def __signature__(self):  # generate inspects the forward's parameters
        return inspect.signature(self.original)

    def _is_decode_step(self, args, kwargs) -> bool:
        ids = kwargs.get("input_ids")
        return (
            not args and kwargs.get(self.keyword) is self.cache and ids is not None and ids.dim() == 2
            and ids.shape[1] == 1 and not any(kwargs.get(k) for k in self._PASSED_THROUGH)
            and kwargs.get("inputs_embeds") is None and kwargs.get("use_cache", True) is not False
            and self.output_type is not None
        )

    def _positions(self, kwargs, batch):
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and position_ids.shape == (batch, 1):
            return position_ids
        if isinstance(self.cache, PagedLatentCache) and self.cache.paged:
            return self.cache.next_positions(batch)  # the cached tokens, less the row's left padding
        try:
            seen = self.cache.get_seq_length()
        except ValueError:  # only state (Mamba) layers: nothing positional is cached, and nothing reads positions
            seen = 0
        return torch.full((batch, 1), seen, device=self.graph.device, dtype=torch.long)

    def __call__(self, *args, **kwargs):
        if self._inside or not self._is_decode_step(args, kwargs):
            out = self.original(*args, **kwargs)
            if self.output_type is None and hasattr(out, "logits"):
                self.cache_field = _cache_field(out, self.cache)
                if self.cache_field is not None:  # (else every step runs the model's own forward)
                    self.output_type = type(out)
            return out
        ids = kwargs["input_ids"]
        self._inside = True
        try:
            logits = self.graph(ids, self._positions(kwargs, ids.shape[0]))
        finally:
            self._inside = False
        self.steps += 1
        # positionally: Transformers may rename keyword arguments of outputs between releases (5.24 maps
        # ``cache_params=`` to ``cache=``), the field order is what the class itself defines
        values = {"logits": logits.unsqueeze(1), self.cache_field: self.cache}
        return self.output_type(*(values.get(name) for name in self.output_type.__dataclass_fields__))


def _cache_field(output, cache) -> str | None:
    """The field of a model output that carries the cache.  Read off the model's own output (the field holding
    ``cache``, else any ``Cache``), never from a fixed list: Transformers names it ``cache``, ``past_key_values``
    or ``cache_params`` depending on the model and the release (Mamba-2's is ``cache_params`` in 5.23, ``cache``
    in 5.24)."""
    from transformers.cache_utils import Cache

    fields = list(getattr(type(output), "__dataclass_fields__", {}))
    for match in (lambda v: v is cache, lambda v: isinstance(v, Cache)):
        found = [name for name in fields if match(getattr(output, name, None))]
        if found:
            return found[0]
    return None


def graphed_generate_plan(model, args, kwargs):
    """``(batch, max_seq_len, starts)`` when this ``generate`` call can replay its decode steps from a CUDA graph
    over a static paged cache, else None: CUDA, no cache or cache implementation asked for, one beam, no
    assistant, input ids unpadded or left-padded (``starts``: padding per row, or None) and enough new tokens to
    repay the capture."""
    device = model.get_input_embeddings().weight.device
    if device.type != "cuda" or not cuda_graphs_wanted() or torch.cuda.is_current_stream_capturing():
        return None
    return generate_shape(model, args, kwargs)


def generate_shape(model, args, kwargs):
    """The device-independent part of :func:`graphed_generate_plan`."""
    config = kwargs.get("generation_config") or model.generation_config

    def setting(name, default=None):
        return kwargs.get(name, getattr(config, name, default))

    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or kwargs.get("inputs_embeds") is not None:
        return None
    if (setting("num_beams", 1) or 1) != 1 or kwargs.get("assistant_model") is not None \
            or setting("prompt_lookup_num_tokens") or kwargs.get("synced_gpus"):
        return None
    if setting("use_cache", True) is False or setting("cache_implementation") is not None:
        return None
    mask = kwargs.get("attention_mask")
    starts = None
    if mask is not None and not bool(mask.all()):
        starts = _left_padding(mask)
        if starts is None:
            return None  # right or inner padding: the steps take the masked path
    new_tokens = setting("max_new_tokens")
    if new_tokens is None:
        max_length = setting("max_length")
        new_tokens = None if max_length is None else max_length - ids.shape[1]
    if new_tokens is None or new_tokens < GENERATE_MIN_NEW_TOKENS:
        return None
    copies = setting("num_return_sequences", 1) or 1
    if starts is not None:
        starts = starts.repeat_interleave(copies)
    return ids.shape[0] * copies, ids.shape[1] + new_tokens + 1, starts


def _left_padding(mask: torch.Tensor) -> torch.Tensor | None:
    """Per-row count of leading padding tokens of a 2-D 0/1 mask that is left padding, else None."""
    starts = left_padding_of(mask.bool()) if mask.dim() == 2 else None
    return None if starts is None else starts.cpu()


