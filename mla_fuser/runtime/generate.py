"""The runtime layer's ``generate``: one wrapper, bound to a fused model instance, that decides in one place

* the **cache**: a fused MLA model (using ``vllm_mla``) whose caller settles no cache (``compat.caller_chose_cache``)
  gets a ``PagedLatentCache``;
* the **graph plan** (:func:`plan_generate`): on CUDA, decode steps replay a CUDA graph (:class:`GraphedForward`
  over a static paged cache, or over Transformers' own cache of a Mamba model whose layers all keep fixed-size
  states) for greedy, sampling, beam search and the verification steps of assisted and prompt-lookup decoding
  (several tokens per step, graphed per bucket of token counts), unpadded or with any padding, with no cache given,
  a static ``PagedLatentCache``, a ``DynamicCache`` or ``StaticCache`` the caller passes (converted: the tokens it
  holds written in first, what the call adds appended at the end; ``callers_cache``),
  or ``cache_implementation="static"`` / ``"dynamic"``; a forward the caller compiled runs its own compiled steps
  over a static paged cache; every other call runs eagerly, the reason kept in :func:`last_generate_plan`.
  ``MLA_FUSER_CUDA_GRAPHS=0`` turns graphs off.  In a graphed single-beam greedy or sampling call each replayed
  step is launched as soon as its input token is chosen, while Transformers' loop prepares the step
  (``runtime.step_ahead``);
* the **experts implementation**: experts the MoE fuser switched stay on the fused kernel through ``generate``'s
  decode-time swap to ``batched_mm`` (``fusers.moe.keep_fused_experts``); a user's own choice still wins.

The class and Transformers stay untouched; a choice of the caller that we do not graph (a growing cache, other
cache classes, ``use_cache=False``, see ``callers_cache.refusal``) is passed through as given.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
from dataclasses import dataclass, field

import torch

from .. import envs
from ..context_flags import ContextFlag
from ..attention_interfaces.vllm_mla import left_padding_of
from ..attention_interfaces.paged import MAX_STEP_TOKENS
from ..cache import PagedLatentCache, paged_layer_indices
from ..compat import ATTENTION_NAME, CACHE_KWARGS, attention_implementation, cache_keyword, caller_chose_cache
from ..fusers.moe.experts import keep_fused_experts, switched_experts_views
from ..plans import model_state
from . import callers_cache, kept_steps, step_ahead
from .compiled_forward import (
    COMPILED_BY_CALLER, PADDING_NOT_COMPILED, caller_compiled_forward, forward_uncompiled, prefill_uncompiled,
    uncompiled_forward,
)
from .decode_graph import DecodeGraph
from .step_ahead import StepAhead

# Fewer new tokens than this do not repay the capture (about one eager step plus instantiation).
GENERATE_MIN_NEW_TOKENS = 8
# cache implementations a graphed call serves with its own static paged cache (neither is an object the caller holds)
GRAPHED_CACHE_IMPLEMENTATIONS = ("static", "dynamic")


def extend_generate(model) -> list[str]:
    """Bind the runtime layer's ``generate`` to ``model`` (once); returns report notes saying what it does, empty
    when there is nothing to do (no fused MLA layer, no graph-capable Mamba cache, no switched experts)."""
    state = model_state(model)
    if state.generate_extended or not hasattr(model, "generate"):
        return []
    paged = bool(paged_layer_indices(model))
    states_only = not paged and _graphs_over_own_cache(model)
    experts = switched_experts_views(model)  # (found once: fusion set them, and every call would walk the modules)
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
        with keep_fused_experts(self, experts) if experts else contextlib.nullcontext():
            _LAST_PLANS.pop(self, None)  # (its cache is freed before this call's is made, unless kept)
            plan = plan_generate(self, args, kwargs, paged, states_only)
            if plan.uncompiled_call:  # (padding a compiled step cannot decode: the call as if never compiled)
                with forward_uncompiled(self):
                    plan = plan_generate(self, args, kwargs, paged, states_only)
                    plan.reason = "; ".join(filter(None, (PADDING_NOT_COMPILED, plan.reason)))
                    return run(self, plan, args, kwargs)
            return run(self, plan, args, kwargs)

    def run(self, plan, args, kwargs):
        _LAST_PLANS[self] = plan
        if plan.cache is None:
            return inner(*args, **kwargs)
        kwargs = plan.arguments(kwargs, keyword)
        if plan.prefill_uncompiled:
            return run_compiled(self, inner, plan, args, kwargs)
        if not plan.graphed:
            return inner(*args, **kwargs)
        plan.take_in()
        out = generate_graphed(self, inner, plan.cache, args, kwargs, padding=plan.padding, plan=plan)
        return plan.hand_back(out)

    model.generate = types.MethodType(generate, model)
    state.generate_extended = True
    return notes


_LAST_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def last_generate_plan(model) -> "GeneratePlan | None":
    """The plan of ``model``'s last ``generate`` call (diagnostics: whether its decode steps were graphed, why not,
    how many steps replayed and how often the step was captured)."""
    return _LAST_PLANS.get(model)


@dataclass
class GeneratePlan:
    """What the runtime layer does with one ``generate`` call."""

    cache: object = None  # the cache the call runs with when we choose or convert it (None: as the caller asked)
    graphed: bool = False  # decode steps go through a DecodeGraph (captured on CUDA)
    reason: str = ""  # why the decode steps run eagerly, when they do
    padding: torch.Tensor | None = None  # the prompt's mask as generate expands it, when it pads (see generate_graphed)
    give_back: object = None  # the caller's DynamicCache / StaticCache: filled from ``cache`` when the call returns
    held: int = 0  # tokens ``give_back`` held when the call began (written into ``cache`` first: ``take_in``)
    overrides: dict = field(default_factory=dict)  # generate arguments we settle (cache_implementation=None)
    steps: int = 0  # decode steps that went through the DecodeGraph
    captures: int = 0  # CUDA-graph captures of those steps (0 when the call replayed a kept graph)
    layouts: int = 0  # cache memory layouts the steps ran on (each after the first would be a recapture)
    graph: DecodeGraph | None = None  # a DecodeGraph kept by an earlier call over ``cache`` (runtime.kept_steps)
    keep_key: tuple | None = None  # the shape under which the call keeps its cache and graph (None: not kept)
    fingerprint: tuple | None = None  # kept_steps.model_fingerprint at the call's start (read once per call)
    left: tuple | None = None  # (left_padding()'s value,) once read: the mask is reduced and read on the host once
    ahead_until: int | None = None  # the length up to which a step may be launched ahead (runtime.step_ahead)
    steps_ahead: int = 0  # decode steps launched ahead and taken by the forward that asked for them
    taken_back: int = 0  # steps launched ahead that nobody asked for (the call's end), taken back
    prefill_uncompiled: bool = False  # the caller compiled the forward: its prefill runs uncompiled (below)
    uncompiled_call: bool = False  # the caller compiled the forward, but the padding needs the call uncompiled

    def left_padding(self) -> torch.Tensor | None:
        """Per row, the prompt's leading padding when ``padding`` is left padding, else None (read once per call)."""
        if self.left is None:
            self.left = (None if self.padding is None else _left_padding(self.padding),)
        return self.left[0]

    def arguments(self, kwargs: dict, keyword: str) -> dict:
        """``kwargs`` with our cache under the model's keyword (any other cache keyword dropped) and our overrides."""
        out = {k: v for k, v in kwargs.items() if k not in CACHE_KWARGS}
        out.update(self.overrides)
        out[keyword] = self.cache
        return out

    def take_in(self) -> None:
        """The tokens the caller's cache holds written into the call's cache, before the call (``callers_cache``)."""
        if self.give_back is not None and self.held:
            callers_cache.take_in(self.give_back, self.cache, self.held)

    def hand_back(self, out):
        """The caller's ``DynamicCache`` or ``StaticCache`` gets what the call added (in native's layout, through its
        own ``update``), and an output that carries a cache carries the caller's."""
        if self.give_back is None:
            return out
        callers_cache.fill(self.give_back, self.cache, self.held)
        for name in getattr(type(out), "__dataclass_fields__", ()):
            if getattr(out, name, None) is self.cache:
                setattr(out, name, self.give_back)
        return out


def plan_generate(model, args, kwargs, paged: bool, states_only: bool) -> GeneratePlan:
    """The :class:`GeneratePlan` of one call of a fused model's ``generate``."""
    graphs = graphs_possible(model)
    if not paged:  # a fused Mamba model: one beam (a reorder moves its states), no cache chosen
        if states_only and graphs and not caller_chose_cache(model, kwargs) and generate_shape(model, args, kwargs):
            from transformers import DynamicCache

            return GeneratePlan(DynamicCache(config=model.config), graphed=True)  # (padding is no matter to states)
        return GeneratePlan(reason="a states-only model graphs one-beam calls with no cache chosen, on CUDA")
    if attention_implementation(model) != ATTENTION_NAME:  # switched away after fusion: the class's own forward
        return GeneratePlan(reason=f"attention implementation {attention_implementation(model)!r}, not vllm_mla")
    config = kwargs.get("generation_config") or model.generation_config
    if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
        return GeneratePlan(reason="use_cache=False")
    user = next(((k, kwargs[k]) for k in CACHE_KWARGS if kwargs.get(k) is not None), None)
    implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
    shape = call_shape(model, args, kwargs)
    if caller_compiled_forward(model):
        return _plan_for_compiled_forward(model, shape, user, implementation)
    reason = shape.reason or ("" if graphs else "no CUDA graphs here (CPU, MLA_FUSER_CUDA_GRAPHS=0, eager_decode() "
                                                "or capturing)")
    if user is None and implementation is None:
        if reason:
            return GeneratePlan(PagedLatentCache(model), reason=reason)
        return _graphed_over_own_cache(model, shape, fallback=lambda: PagedLatentCache(model))
    if reason:
        return GeneratePlan(reason=reason)
    if user is None:
        if implementation not in GRAPHED_CACHE_IMPLEMENTATIONS:
            return GeneratePlan(reason=f"cache_implementation={implementation!r} is Transformers' own cache")
        return _graphed_over_own_cache(model, shape, overrides={"cache_implementation": None})
    return _plan_for_callers_cache(model, user[1], shape)


def _plan_for_compiled_forward(model, shape: "CallShape", user, implementation) -> GeneratePlan:
    """The caller's compiled forward runs every decode step.  With no cache chosen (or
    ``cache_implementation="static"``), over a static paged cache: fixed addresses, as a compiled forward's CUDA
    graphs need, and the prefill on the forward as it was before compiling (:func:`prefill_uncompiled`); else as the
    caller asked."""
    if user is not None or (implementation is not None and implementation not in GRAPHED_CACHE_IMPLEMENTATIONS):
        return GeneratePlan(reason=COMPILED_BY_CALLER)
    overrides = {"cache_implementation": None} if implementation is not None else {}
    uncompiled = uncompiled_forward(model) is not None
    if shape.reason:  # (nothing to size a static cache by, or a strategy our plan leaves as it is)
        return GeneratePlan(PagedLatentCache(model), reason=f"{COMPILED_BY_CALLER}; {shape.reason}",
                            overrides=overrides, prefill_uncompiled=uncompiled)
    left = None if shape.padding is None else _left_padding(shape.padding)
    if shape.padding is not None and left is None and uncompiled:
        return GeneratePlan(uncompiled_call=True)
    cache, _, key, fingerprint = _own_static_cache(model, shape, left)  # (a kept one: its marked buffers, no compile)
    overrides["disable_compile"] = True  # (a safeguard: never Transformers' compile around the caller's; see there)
    return GeneratePlan(cache, reason=COMPILED_BY_CALLER, overrides=overrides, prefill_uncompiled=uncompiled,
                        keep_key=key, fingerprint=fingerprint)


def run_compiled(model, inner, plan: GeneratePlan, args, kwargs):
    """A call whose forward the caller compiled, over the plan's static paged cache (``compiled_forward``); the
    cache is kept for the model's next call of the same shape unless the output carries it."""
    with prefill_uncompiled(model, plan.cache):
        out = inner(*args, **kwargs)
    if _cache_field(out, plan.cache) is None:
        kept_steps.keep(model, plan.keep_key, plan.cache, None, plan.fingerprint)
    return out


def _plan_for_callers_cache(model, cache, shape: "CallShape") -> GeneratePlan:
    """A cache the caller passed: a static ``PagedLatentCache`` is replayed over as it is; a ``DynamicCache`` or
    ``StaticCache`` that ``callers_cache`` converts runs on a static paged cache (the tokens it holds written in
    first, what the call adds appended to it at the end); anything else runs as given, eagerly, with the reason."""
    if isinstance(cache, PagedLatentCache):
        if not cache.static:
            return GeneratePlan(reason="a growing PagedLatentCache moves its memory; pass static=True "
                                       "(PagedLatentCache.static_for) to replay decode steps")
        return _graphed(model, cache, shape)
    why = callers_cache.refusal(cache, shape)
    if why:
        return GeneratePlan(reason=why)
    return _graphed_over_own_cache(model, shape, give_back=cache, held=callers_cache.held_tokens(cache))


def _graphed(model, cache, shape: "CallShape", fallback=None, **extra) -> GeneratePlan:
    """A graphed plan over ``cache``, or, when a step cannot be replayed over it (a layer that is not paged: hybrid
    models, DSA indexer caches), an eager plan with the reason and the cache ``fallback()`` gives (None: the
    caller's or Transformers' choice stands)."""
    try:
        DecodeGraph(model, cache, capture=False)  # its checks only
    except (TypeError, ValueError) as err:
        return GeneratePlan(None if fallback is None else fallback(), reason=str(err))
    return GeneratePlan(cache, graphed=True, padding=shape.padding, ahead_until=shape.ahead_until, **extra)


def _graphed_over_own_cache(model, shape: "CallShape", fallback=None, **extra) -> GeneratePlan:
    """A graphed plan over a static paged cache of our own (the caller holds none): the one the model's last call
    kept with its captured step, where the shape and the model still match (``kept_steps``), else a new one, kept in
    turn when the call returns."""
    extra["left"] = (None if shape.padding is None else _left_padding(shape.padding),)  # (the plan's, read once)
    cache, graph, key, fingerprint = _own_static_cache(model, shape, extra["left"][0])
    if graph is not None:
        return GeneratePlan(cache, graphed=True, padding=shape.padding, graph=graph, keep_key=key,
                            fingerprint=fingerprint, ahead_until=shape.ahead_until, **extra)
    plan = _graphed(model, cache, shape, fallback=fallback, **extra)
    plan.keep_key, plan.fingerprint = (key, fingerprint) if plan.graphed else (None, None)
    return plan


def _own_static_cache(model, shape: "CallShape", left) -> tuple:
    """``(cache, graph, keep key, fingerprint)`` of a static paged cache of our own for the call: the one (and the
    captured step, possibly None) the model's last call kept where the shape and the model still match
    (``kept_steps``), else a new one sized to be kept in turn (``graph`` None); ``left``: the call's left padding."""
    key = kept_steps.step_key(model, shape.batch, shape.max_seq_len, shape.padding, left is not None)
    fingerprint = None if key is None else kept_steps.model_fingerprint(model)
    found = kept_steps.take(model, key, fingerprint)
    if found is not None:
        return (*found, key, fingerprint)
    size = shape.max_seq_len if key is None else kept_steps.cache_size(shape.max_seq_len)
    return PagedLatentCache.static_for(model, shape.batch, size), None, key, fingerprint


def _graphs_over_own_cache(model) -> bool:
    """Whether every layer of the model's own default cache keeps fixed-size states (a fused Mamba model), so its
    decode steps can replay a graph over Transformers' cache."""
    from transformers import DynamicCache

    try:
        DecodeGraph(model, DynamicCache(config=model.config), capture=False)
    except (ValueError, TypeError):
        return False
    return True


def generate_graphed(model, inner, cache, args, kwargs, padding=None, plan: GeneratePlan | None = None):
    """``inner(*args, **kwargs)`` with the decode steps over ``cache`` going through a :class:`DecodeGraph`.

    ``padding``: the prompt's mask (``[batch, T]`` as generate expands it) when the batch is padded; the steps get
    no mask, so the cache carries the padding: left padding is set before the prefill, any other padding is moved
    to the left right after it (``PagedLatentCache.move_padding_left``); both are undone when the call returns, so
    the cache reads as native's would.  How many steps went through the graph and how often it was captured are
    kept in the model's state (and ``plan``)."""
    previous = cache.padding_starts if padding is not None else None
    if plan is not None and plan.padding is padding:
        starts = plan.left_padding()
    else:
        starts = None if padding is None else _left_padding(padding)
    if starts is not None:
        cache.set_left_padding(starts)
    kept = False
    # (``generate``'s fourth positional argument is ``stopping_criteria``: given so, ours cannot join it)
    try:
        with GraphedForward(model, cache, move_padding=padding if starts is None else None,
                            graph=None if plan is None else plan.graph,
                            ahead_until=None if plan is None or len(args) > 3 else plan.ahead_until) as graphed:
            out = inner(*args, **graphed.with_step_ahead(kwargs))
        if plan is not None and (plan.give_back is not None or _cache_field(out, cache) is None):  # (not the caller's)
            kept = kept_steps.keep(model, plan.keep_key, cache, graphed.graph, plan.fingerprint)
    finally:
        if padding is not None and not kept:  # (a kept cache's next call sets its own padding, in place)
            cache.restore_padding()
            cache.set_left_padding(previous)
    captures, layouts = (now - before for now, before in zip((graphed.graph.captures, graphed.graph.layouts),
                                                              graphed.counts_before))
    state = model_state(model)
    state.graphed_steps, state.graph_captures = graphed.steps, captures
    if plan is not None:
        plan.steps, plan.captures, plan.layouts = graphed.steps, captures, layouts
        if graphed.ahead is not None:
            plan.steps_ahead, plan.taken_back = graphed.ahead.taken, graphed.ahead.taken_back
    return out


def graphs_possible(model) -> bool:
    """Whether this call may capture: the model on CUDA, ``MLA_FUSER_CUDA_GRAPHS`` not off, no capture running.  (On
    other devices a :class:`DecodeGraph` runs the same step eagerly; tests force this to exercise the graphed plan
    on a CPU.)"""
    device = model.get_input_embeddings().weight.device
    return device.type == "cuda" and cuda_graphs_wanted() and not torch.cuda.is_current_stream_capturing()


_NO_CUDA_GRAPHS = ContextFlag("no_cuda_graphs", False)


def eager_decode():
    """Within it, ``generate`` of a fused model runs its decode steps eagerly, for this thread / task only: what
    ``MLA_FUSER_CUDA_GRAPHS=0`` does for the whole process, without touching the environment (a benchmark's eager
    row, a debugging session)."""
    return _NO_CUDA_GRAPHS.set_to(True)


def cuda_graphs_wanted() -> bool:
    """``MLA_FUSER_CUDA_GRAPHS=0`` (the process) or :func:`eager_decode` (a block) turns the graphed decode of
    ``generate`` off."""
    return envs.cuda_graphs_enabled() and not _NO_CUDA_GRAPHS.get()


class GraphedForward:
    """A forward for one ``generate`` call: decode steps over ``cache`` replay a :class:`DecodeGraph`, every other
    call (the prefill, anything with inputs the graph does not take) runs the model's own forward.

    Bound to the model instance for the duration of the call (``with GraphedForward(model, cache):``); the
    output of a replayed step has the type and cache field of the model's own output, with last-token logits.
    ``move_padding`` (a ``[batch, T]`` mask): once the cache holds ``T`` tokens per sequence (after the prefill),
    their padding is moved to the left (``PagedLatentCache.move_padding_left``), before any step reads the cache.
    ``ahead_until``: the call's final length when it may launch steps ahead (``runtime.step_ahead``; single-beam
    greedy or sampling, not verification), else None."""

    _PASSED_THROUGH = ("labels", "output_attentions", "output_hidden_states")

    def __init__(self, model, cache, move_padding: torch.Tensor | None = None, graph: DecodeGraph | None = None,
                 ahead_until: int | None = None):
        self.model = model
        self.cache = cache
        self.move_padding = move_padding
        self.keyword = cache_keyword(model)
        if graph is not None and graph.cache is not cache:
            raise ValueError("GraphedForward: the graph given was captured over another cache")
        self.graph = DecodeGraph(model, cache) if graph is None else graph
        self.counts_before = self.graph.begin_call()  # (captures, layouts) before this call
        self.output_type = None
        self.cache_field = None  # the output's cache field, read off the first eager output (_cache_field)
        self.steps = 0  # decode steps that went through the graph (the first one runs eagerly inside it)
        self._inside = False  # the graph's own eager step and capture call the model: those run the original
        self.ahead_until = ahead_until
        self.ahead: StepAhead | None = None  # set on entering, where steps may be launched ahead

    def __enter__(self):
        self.previous = self.model.__dict__.get("forward")
        self.original = self.model.forward
        self._signature = inspect.signature(self.original)  # generate asks for it on every step
        self.model.forward = self
        self._previous_prepare = self.model.__dict__.get("prepare_inputs_for_generation", _NOTHING)
        self._original_prepare = None
        if _plain_prepare(self.model):
            self._original_prepare = self.model.prepare_inputs_for_generation
            prepare = functools.partial(_prepare_step_inputs, self)
            prepare.__signature__ = inspect.signature(self._original_prepare)  # (generate checks its kwargs by it)
            self.model.prepare_inputs_for_generation = prepare
        if (self.ahead_until is not None and step_ahead.LAUNCH_AHEAD and envs.step_ahead()
                and self._original_prepare is not None and self.move_padding is None
                and isinstance(self.cache, PagedLatentCache) and self.graph.takes_several_tokens
                and (self.graph.capture or step_ahead.WITHOUT_CAPTURE)):
            self.ahead = StepAhead(self, self.ahead_until)
        return self

    def with_step_ahead(self, kwargs: dict) -> dict:
        """``generate``'s keyword arguments with the criterion that launches steps ahead after the caller's own
        stopping criteria (when steps are launched ahead)."""
        if self.ahead is None:
            return kwargs
        from transformers import StoppingCriteriaList

        return {**kwargs, "stopping_criteria": StoppingCriteriaList([*(kwargs.get("stopping_criteria") or ()),
                                                                     self.ahead.criterion()])}

    def __exit__(self, *exc):
        if self.ahead is not None:
            self.ahead.close()  # (a step launched after the last token: the cache reads as without it)
        if self.previous is None:
            del self.model.__dict__["forward"]
        else:
            self.model.forward = self.previous
        if self._original_prepare is not None:
            if self._previous_prepare is _NOTHING:
                del self.model.__dict__["prepare_inputs_for_generation"]
            else:
                self.model.prepare_inputs_for_generation = self._previous_prepare
        return False

    @property
    def __signature__(self):  # generate inspects the forward's parameters
        return self._signature

    def _is_decode_step(self, args, kwargs) -> bool:
        """One new token per sequence, or (over paged layers only) up to ``MAX_STEP_TOKENS`` of them: a verification
        step of assisted or prompt-lookup decoding, once the prompt is in the cache."""
        ids = kwargs.get("input_ids")
        if (args or kwargs.get(self.keyword) is not self.cache or ids is None or ids.dim() != 2
                or any(kwargs.get(k) for k in self._PASSED_THROUGH) or kwargs.get("inputs_embeds") is not None
                or kwargs.get("use_cache", True) is False or self.output_type is None):
            return False
        tokens = ids.shape[1]
        # (a cache with state layers steps one token at a time and verifies eagerly)
        return tokens == 1 or (tokens <= MAX_STEP_TOKENS and self.graph.takes_several_tokens
                               and self.cache.get_seq_length() > 0)

    def _positions(self, kwargs, batch, tokens=1):
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and position_ids.shape == (batch, tokens):
            return position_ids
        if isinstance(self.cache, PagedLatentCache) and self.cache.paged:
            first = self.cache.next_positions(batch)  # the cached tokens, less the row's left padding
        else:
            try:
                seen = self.cache.get_seq_length()
            except ValueError:  # only state (Mamba) layers: nothing positional is cached, and nothing reads positions
                seen = 0
            first = torch.full((batch, 1), seen, device=self.graph.device, dtype=torch.long)
        return first if tokens == 1 else first + torch.arange(tokens, device=first.device)

    def __call__(self, *args, **kwargs):
        ahead = self.ahead
        if ahead is not None and ahead.pending is not None and not self._inside:
            logits = ahead.take(kwargs, self._is_decode_step(args, kwargs))
            if logits is not None:
                self.steps += 1
                return self._output(logits, kwargs)
        if self._inside or not self._is_decode_step(args, kwargs):
            out = self.original(*args, **kwargs)
            mask = self.move_padding
            if mask is not None and not self._inside and self.cache.get_seq_length() == mask.shape[1]:
                self.cache.move_padding_left(mask)
                self.move_padding = None
            if self.output_type is None and hasattr(out, "logits"):
                self.cache_field = _cache_field(out, self.cache)
                if self.cache_field is not None:  # (else every step runs the model's own forward)
                    self.output_type = type(out)
            return out
        ids = kwargs["input_ids"]
        self._inside = True
        try:
            logits = self.graph(ids, self._positions(kwargs, *ids.shape))
        finally:
            self._inside = False
        self.steps += 1
        return self._output(logits, kwargs)

    def _output(self, logits, kwargs):
        """A replayed step's output: the model's own output type, its logits and the cache."""
        logits = logits.unsqueeze(1) if logits.dim() == 2 else logits
        keep = kwargs.get("logits_to_keep")
        if isinstance(keep, int) and 0 < keep < logits.shape[1]:
            logits = logits[:, -keep:]
        # positionally: Transformers may rename keyword arguments of outputs between releases (5.24 maps
        # ``cache_params=`` to ``cache=``), the field order is what the class itself defines
        values = {"logits": logits, self.cache_field: self.cache}
        return self.output_type(*(values.get(name) for name in self.output_type.__dataclass_fields__))


_NOTHING = object()
# graphed calls prepare their replayed steps' inputs themselves (read when a call starts: benchmarks flip it for a
# same-process A/B of the host time)
PREPARE_STEP_INPUTS = True
# what Transformers (5.2x) hands ``prepare_inputs_for_generation`` on a decode step of a causal LM, besides the ids
_STEP_INPUTS = frozenset({"attention_mask", "position_ids", "logits_to_keep", "use_cache"})


def _plain_prepare(model) -> bool:
    """Whether ``model`` prepares its step inputs with Transformers' generic ``prepare_inputs_for_generation`` of the
    releases that slice by ``next_sequence_length`` (a model class's own, or an older release's, is left alone)."""
    from transformers.generation.utils import GenerationMixin

    generic = getattr(GenerationMixin, "prepare_inputs_for_generation", None)
    return (PREPARE_STEP_INPUTS and generic is not None
            and getattr(type(model), "prepare_inputs_for_generation", None) is generic
            and "prepare_inputs_for_generation" not in model.__dict__
            and "next_sequence_length" in inspect.signature(generic).parameters
            and not getattr(model.config, "is_encoder_decoder", False))


def _prepare_step_inputs(graphed: "GraphedForward", input_ids, next_sequence_length=None, **kwargs):
    """Transformers' ``prepare_inputs_for_generation`` for the decode steps :class:`GraphedForward` replays, in a few
    dictionary operations: the same keys and values, the last token's ids and positions as views (the generic
    version clones them, a host cost the GPU waits for; the replay copies them into its own buffers anyway).  Any
    other call (prefill, several tokens, another cache, embeddings, an argument outside ``_STEP_INPUTS``) goes to
    Transformers' own."""
    keyword = graphed.keyword
    if (next_sequence_length != 1 or kwargs.get(keyword) is not graphed.cache or graphed.output_type is None
            or kwargs.get("is_first_iteration") or kwargs.get("inputs_embeds") is not None
            or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2
            or input_ids.device != graphed.graph.device or kwargs.get("use_cache", True) is False
            or any(k not in _STEP_INPUTS and k not in (keyword, "is_first_iteration", "inputs_embeds")
                   for k in kwargs)):
        return graphed._original_prepare(input_ids, next_sequence_length=next_sequence_length, **kwargs)
    inputs = {"input_ids": input_ids[:, -1:], keyword: graphed.cache}
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        inputs["position_ids"] = position_ids[..., -1:]
    for key in ("attention_mask", "logits_to_keep", "use_cache"):
        if kwargs.get(key) is not None:
            inputs[key] = kwargs[key]
    return inputs


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


@dataclass
class CallShape:
    """The shape of a ``generate`` call's decode steps, as the cache sees them: ``batch`` sequences (prompts times
    beams or returned sequences) of up to ``max_seq_len`` tokens, ``padding`` the prompt's mask expanded the way
    generate expands it (None when nothing is padded); ``reason`` says why its steps cannot be replayed ("" when
    they can)."""

    batch: int = 0
    max_seq_len: int = 0
    padding: torch.Tensor | None = None
    reason: str = ""
    beams: int = 1
    ahead_until: int | None = None  # the final length, where steps may be launched ahead (one beam, no verification)
    prompt: int = 0  # the prompt's length (tokens a caller's cache holds included)
    length: int = 0  # the final length of each sequence (prompt and new tokens)
    verifies: bool = False  # assisted or prompt-lookup decoding: verification steps of several tokens


# generate arguments whose decoding strategy runs model calls a replayed step does not make
_EAGER_STRATEGIES = {
    "synced_gpus": "synced_gpus keeps running forwards after the end",
    "output_attentions": "steps that return attentions run the model's forward",
    "output_hidden_states": "steps that return hidden states run the model's forward",
    "dola_layers": "DoLa reads hidden states of every step",
    "penalty_alpha": "contrastive search",
    "custom_generate": "a custom generate",
    "constraints": "constrained beam search",
    "force_words_ids": "constrained beam search",
}


def call_shape(model, args, kwargs) -> CallShape:
    """The :class:`CallShape` of a ``generate`` call (device-independent; :func:`plan_generate` adds the device)."""
    config = kwargs.get("generation_config") or model.generation_config

    def setting(name, default=None):
        return kwargs.get(name, getattr(config, name, default))

    ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() \
            or kwargs.get("inputs_embeds") is not None:
        return CallShape(reason="inputs_embeds or input ids that are not [batch, length]")
    for name, why in _EAGER_STRATEGIES.items():
        if setting(name):
            return CallShape(reason=why)
    if (setting("num_beam_groups", 1) or 1) > 1:
        return CallShape(reason="group beam search")
    new_tokens = setting("max_new_tokens")
    if new_tokens is None:
        max_length = setting("max_length")
        new_tokens = None if max_length is None else max_length - ids.shape[1]
    if new_tokens is None or new_tokens < GENERATE_MIN_NEW_TOKENS:
        return CallShape(reason=f"fewer than {GENERATE_MIN_NEW_TOKENS} new tokens do not repay a capture")
    beams = setting("num_beams", 1) or 1
    copies = beams if beams > 1 else (setting("num_return_sequences", 1) or 1)
    mask = _prompt_mask(ids, kwargs.get("attention_mask"), setting("pad_token_id"), setting("eos_token_id"))
    padding = None if mask is None or bool(mask.all()) else mask.bool().repeat_interleave(copies, dim=0)
    # assisted / prompt-lookup verification writes candidates past the last kept token (then crops them): room for a
    # whole step's bucket beyond the end
    verifies = setting("assistant_model") is not None or bool(setting("prompt_lookup_num_tokens"))
    room = ids.shape[1] + new_tokens + 1 + (MAX_STEP_TOKENS if verifies else 0)
    ahead_until = None if beams > 1 or verifies else ids.shape[1] + new_tokens
    return CallShape(ids.shape[0] * copies, room, padding, beams=beams, ahead_until=ahead_until,
                     prompt=ids.shape[1], length=ids.shape[1] + new_tokens, verifies=verifies)


def _prompt_mask(ids, mask, pad, eos):
    """The mask generate attends the prompt with: the caller's, else the one it infers from pad tokens in the ids
    (when the pad token is set, present and not an end token)."""
    if mask is not None or pad is None:
        return mask
    ends = eos if isinstance(eos, (list, tuple)) else [eos]
    if pad in ends or not bool((ids == pad).any()):
        return None
    return ids.ne(pad)


def graphed_generate_plan(model, args, kwargs):
    """:func:`generate_shape` when the call may capture (:func:`graphs_possible`), else None."""
    return generate_shape(model, args, kwargs) if graphs_possible(model) else None


def generate_shape(model, args, kwargs):
    """``(batch, max_seq_len, starts)`` of a call graphed with no cache chosen, one beam and no padding other than on
    the left (``starts``: per row, or None), else None: the first graphed plan's subset of :func:`call_shape`, kept
    for its callers."""
    config = kwargs.get("generation_config") or model.generation_config
    shape = call_shape(model, args, kwargs)
    if shape.reason or shape.beams > 1 or kwargs.get("cache_implementation", config.cache_implementation):
        return None
    starts = None if shape.padding is None else _left_padding(shape.padding)
    if shape.padding is not None and starts is None:
        return None
    return shape.batch, shape.max_seq_len, starts


def _left_padding(mask: torch.Tensor) -> torch.Tensor | None:
    """Per-row count of leading padding tokens of a 2-D 0/1 mask that is left padding, else None."""
    starts = left_padding_of(mask.bool()) if mask.dim() == 2 else None
    return None if starts is None else starts.cpu()
