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
(``PagedLatentCache.set_left_padding``) and the decode kernel skips each row's padding; other padding is moved to
the left after the prefill (``move_padding_left``).  A beam reorder between steps (``reorder_cache``) permutes the
static cache's block-table rows in place, so the captured step stays valid.  Not capturable, refused
with a clear error: caches with dynamic layers (Transformers' ``DynamicCache`` layers, a non-static paged cache)
and prefill (run it eagerly before the first step).
"""

from __future__ import annotations

import inspect

import torch

from ..cache import CachePoolExhausted, PagedLatentCache, PagedLatentLayer
from ..compat import cache_keyword
from ..kernels.dispatch import graph_warmup


def _is_state_layer(layer) -> bool:
    """A Transformers linear-attention (Mamba) layer without a growing attention part: states updated in place."""
    try:
        from transformers.cache_utils import LinearAttentionLayer
    except ImportError:  # pragma: no cover - Transformers without linear-attention cache layers
        return False
    return type(layer) is LinearAttentionLayer and not getattr(layer, "record_past", False)


def _layer_tensors(layer):
    """The device memory a cache layer's decode step reads or writes: a paged layer says (``buffers()``); for any
    other layer every tensor it holds (attributes, lists / dicts of tensors).  Checked before every replay."""
    if isinstance(layer, PagedLatentLayer):
        return layer.buffers()
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
        # memory layouts the steps ran on, counted with or without capture: on CUDA every layout after the one of
        # the first (eager) step is a capture, so this is what tells on a CPU that a reorder kept the graph valid
        self.layouts = 0
        self._addresses = self._seen = None
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
                lens = layer.host_lens  # (read, not copied: this runs before every replay)
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
        saved = [layer.lengths for layer in self._paged_layers()]
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                self._logits = self._forward(self._ids, self._positions)
        finally:
            for layer, lens in zip(self._paged_layers(), saved):
                layer.rewind(lens)
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
        addresses = self._current_addresses()
        if addresses != self._seen:
            self._seen = addresses
            self.layouts += 1
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
        if self.graph is None or addresses != self._addresses:
            self._capture()
        self._ids.copy_(input_ids, non_blocking=True)
        self._positions.copy_(position_ids, non_blocking=True)
        self.graph.replay()
        for layer in self._paged_layers():  # what the replayed kernels did on the device
            layer.advance(1)
        return self._logits.clone()
