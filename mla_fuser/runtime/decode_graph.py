"""One decode step of a fused model captured as a CUDA graph and replayed.

Why: a fused decode step is a few hundred small kernels (27 layers x attention, MoE, norms) whose launch and
Python cost is far larger than their GPU time on an H200: DeepSeek-V2-Lite eager decode is host-bound at any
batch size.  A CUDA graph replays all of them with one launch.

What makes a step capturable is that everything it does on the host is the same at every step and everything
that changes lives in device memory at fixed addresses:

* the static ``PagedLatentCache`` (``static=True``): pages, block tables and sequence lengths are allocated once;
  the page write and the decode kernel read the lengths from device memory and size their grids from the
  block-table width (never from the current length);
* Transformers' linear-attention (Mamba) cache layers: conv and recurrent states are updated in place;
* the inputs: ``input_ids`` and ``position_ids`` are copied into static buffers before each replay.

The host-side bookkeeping that the captured Python code did once (the paged layers' host lengths) is rolled back
after capture and advanced by one token after every replay.  Addresses are checked before each replay: if a cache
moved its memory (a pool grew, a batch changed), the step is captured again, never replayed on stale addresses.

Steps take no attention mask: a left-padded batch is described to the cache once
(``PagedLatentCache.set_left_padding``) and the decode kernel skips each row's padding.  Not capturable, refused
with a clear error: caches with dynamic layers (Transformers' ``DynamicCache`` layers, a non-static paged cache)
and prefill (run it eagerly before the first step).
"""

from __future__ import annotations

import inspect

import torch

from .cache import CachePoolExhausted, PagedLatentCache, PagedLatentLayer, cache_keyword
from .kernels.dispatch import graph_warmup


def _is_state_layer(layer) -> bool:
    """A Transformers linear-attention (Mamba) layer without a growing attention part: states updated in place."""
    try:
        from transformers.cache_utils import LinearAttentionLayer
    except ImportError:  # pragma: no cover - Transformers without linear-attention cache layers
        return False
    return type(layer) is LinearAttentionLayer and not getattr(layer, "record_past", False)


def _layer_tensors(layer):
    """The device memory a cache layer's decode step reads or writes: a paged layer's pool, tables, starts and
    stand-in rows; for any other layer every tensor it holds (attributes, lists / dicts of tensors).  Checked
    before every replay, so the paged case is listed rather than scanned (its host tables are long lists)."""
    if isinstance(layer, PagedLatentLayer):
        pages = None if layer.pool is None else layer.pool.pages
        held = (pages, layer.tables, layer.block_table, layer.seq_lens, layer.starts, *(layer._nan_rows or ()))
        return [t for t in held if t is not None]
    found = []
    for value in list(vars(layer).values()):
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


_NOT_PREFILLED = "DecodeGraph: prefill the prompt into the cache first (an eager forward)"


class DecodeGraph:
    """Run decode steps of ``model`` over ``cache``, captured once as a CUDA graph and replayed.

    Args:
        model: a causal LM (fused or not) whose cache layers are all capturable (see the module docstring).
        cache: the cache the prompt was prefilled into: a ``PagedLatentCache(model, static=True, max_seq_len=...)``
            for a fused MLA model, Transformers' cache for a Mamba model.
        capture: use a CUDA graph (default: when the model is on CUDA).  Without one, steps run eagerly with the
            same checks, which is how CPU machines run the same code.

    Call it with ``input_ids [B, 1]`` and ``position_ids [B, 1]`` (the absolute position of each new token); it
    returns the logits ``[B, vocab]`` of the step (a fresh tensor).  The batch size is fixed by the first call.
    """

    def __init__(self, model, cache, *, capture: bool | None = None):
        self.model = model
        self.cache = cache
        device = model.get_input_embeddings().weight.device
        self.capture = device.type == "cuda" if capture is None else bool(capture)
        if self.capture and device.type != "cuda":
            raise ValueError("DecodeGraph: capture=True needs the model on a CUDA device")
        self.device = device
        self.keyword = cache_keyword(model)
        self.graph = None
        self.captures = 0  # how many times the step was captured (1 unless a cache moved its memory)
        self._addresses = None
        self._ids = self._positions = self._logits = None
        self._check_layers()
        self._paged = [layer for layer in self.cache.layers if isinstance(layer, PagedLatentLayer)]

    # ------------------------------------------------------------------ checks
    def _check_layers(self):
        layers = getattr(self.cache, "layers", None)
        if layers is None:
            raise TypeError(f"DecodeGraph needs a transformers Cache with layers, got {type(self.cache).__name__}")
        if isinstance(self.cache, PagedLatentCache) and not self.cache.static:
            raise ValueError("DecodeGraph needs PagedLatentCache(model, static=True, max_seq_len=...): a growing "
                             "cache moves its memory")
        for idx, layer in enumerate(layers):
            if isinstance(layer, PagedLatentLayer) or _is_state_layer(layer):
                continue
            raise ValueError(
                f"DecodeGraph: cache layer {idx} is a {type(layer).__name__}, whose memory grows with every step "
                f"and cannot be replayed from a graph; use a static PagedLatentCache (fused MLA layers) or a model "
                f"whose layers all keep fixed-size states"
            )

    def _paged_layers(self):
        return self._paged

    def _check_step(self, batch: int):
        """Every step, one pass over the layers: the cache was prefilled, holds this batch and has room for the
        token (a replay past a full static cache would write out of range)."""
        for layer in self.cache.layers:
            if isinstance(layer, PagedLatentLayer):
                lens = layer.host_lens
                longest = max(lens) if lens else 0
                if longest == 0:
                    raise RuntimeError(_NOT_PREFILLED)
                if len(lens) != batch:
                    raise ValueError(f"DecodeGraph: the cache holds {len(lens)} sequences, got a batch of {batch}")
                if longest + 1 > self.cache.max_seq_len:
                    raise CachePoolExhausted(
                        f"static paged latent cache sized for {self.cache.max_seq_len} tokens per sequence is full"
                    )
            else:
                started = getattr(layer, "has_previous_state", {})  # per state index
                values = list(started.values()) if isinstance(started, dict) else list(started)
                if not values or not all(values):
                    raise RuntimeError(_NOT_PREFILLED)

    def _current_addresses(self):
        return tuple(t.data_ptr() for layer in self.cache.layers for t in _layer_tensors(layer))

    # ------------------------------------------------------------------ running
    def _forward(self, input_ids, position_ids):
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=1,
                         **{self.keyword: self.cache})
        return out.logits[:, -1]

    def _capture(self):
        """Capture one step on the static buffers.  Capturing runs no kernel, so device state is untouched; the
        host state the captured Python advanced (paged host lengths) is put back."""
        saved = [list(layer.host_lens) for layer in self._paged_layers()]
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                self._logits = self._forward(self._ids, self._positions)
        finally:
            for layer, lens in zip(self._paged_layers(), saved):
                layer.host_lens = lens
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = graph
        self.captures += 1
        self._addresses = self._current_addresses()

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"DecodeGraph steps one token per sequence: input_ids must be [B, 1], got "
                             f"{tuple(input_ids.shape)}")
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
        batch = input_ids.shape[0]
        self._check_step(batch)
        if not self.capture:
            return self._forward(input_ids.to(self.device), position_ids.to(self.device)).clone()
        if self._ids is None:
            # the first step runs eagerly (on a side stream, as capture will): it compiles every Triton kernel
            # variant and initialises library workspaces, none of which may happen while capturing
            self._ids = torch.zeros_like(input_ids, device=self.device)
            self._positions = torch.zeros_like(position_ids, device=self.device, dtype=torch.long)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), graph_warmup():
                logits = self._forward(input_ids.to(self.device), position_ids.to(self.device)).clone()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            return logits
        if self._ids.shape[0] != batch:
            raise ValueError(f"DecodeGraph was captured for a batch of {self._ids.shape[0]}, got {batch}")
        if self.graph is None or self._current_addresses() != self._addresses:
            self._capture()
        self._ids.copy_(input_ids, non_blocking=True)
        self._positions.copy_(position_ids, non_blocking=True)
        self.graph.replay()
        for layer in self._paged_layers():  # what the replayed kernels did on the device
            layer.host_lens = [n + 1 for n in layer.host_lens]
        return self._logits.clone()


# ----------------------------------------------------------------------------------------------------------------------
# generate(): decode steps replayed from a graph


# Fewer new tokens than this do not repay the capture (about one eager step plus instantiation).
GENERATE_MIN_NEW_TOKENS = 8


def cuda_graphs_wanted() -> bool:
    """``MLA_FUSER_CUDA_GRAPHS=0`` turns the graphed decode of ``generate`` off (read, never written)."""
    from . import envs

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
        paged = self.graph._paged_layers()
        if paged:  # the new token's position: the cached tokens, less the row's left padding
            position = paged[0].seq_lens.view(batch, 1).long()
            starts = paged[0].starts
            return position if starts is None else position - starts.view(batch, 1).long()
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
    from .attention_interfaces.vllm_mla import left_padding_of

    starts = left_padding_of(mask.bool()) if mask.dim() == 2 else None
    return None if starts is None else starts.cpu()


def generate_graphed(model, generate, cache, keyword: str, args, kwargs):
    """``generate(model, *args, **kwargs)`` over ``cache`` with its decode steps replayed from a CUDA graph
    (:class:`GraphedForward`); how many steps were replayed and how often the step was captured are left on the
    model (``_mla_fuser_graphed_steps``, ``_mla_fuser_graph_captures``) for diagnostics."""
    kwargs[keyword] = cache
    with GraphedForward(model, cache) as graphed:
        out = generate(model, *args, **kwargs)
    object.__setattr__(model, "_mla_fuser_graphed_steps", graphed.steps)
    object.__setattr__(model, "_mla_fuser_graph_captures", graphed.graph.captures)
    return out


def install_graphed_generate(model) -> bool:
    """Give ``model.generate`` graphed decode steps when its cache only holds fixed-size states (a fused Mamba
    model: Transformers' linear-attention cache layers), bound to this instance only.  Fused MLA models get the
    same through ``cache.install_auto_paged_cache``.  False when the model's default cache has other layers."""
    import types

    from transformers import DynamicCache

    if getattr(model, "_mla_fuser_auto_cache", False) or not hasattr(model, "generate"):
        return False
    try:
        probe = DynamicCache(config=model.config)
        DecodeGraph(model, probe, capture=False)
    except (ValueError, TypeError):
        return False
    generate = type(model).generate
    keyword = cache_keyword(model)

    def generate_with_graphs(self, *args, **kwargs):
        wants_default = all(kwargs.get(k) is None for k in ("cache", "past_key_values", "cache_params"))
        if not wants_default or graphed_generate_plan(self, args, kwargs) is None:
            return generate(self, *args, **kwargs)  # (padding does not matter to a state-only decode step)
        return generate_graphed(self, generate, DynamicCache(config=self.config), keyword, args, kwargs)

    model.generate = types.MethodType(generate_with_graphs, model)
    object.__setattr__(model, "_mla_fuser_auto_cache", True)
    return True
