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
after capture and advanced by one token after every replay.  The memory is checked before each replay (paged layers
by the moves they count as buffers are replaced, other layers by their tensors' addresses): if a cache moved its
memory (a pool grew, a batch changed), the step is captured again, never replayed on stale addresses.

A step may also feed a few tokens per sequence at once (up to ``MAX_STEP_TOKENS``: assisted and prompt-lookup
verification), over a cache of paged layers only.  Their count is rounded up to a bucket (1, 2, 4, 8, 16) so a few
graphs serve every count: the bucket's extra tokens (copies of the last one, at the following positions) are written
and attended after the real ones, which never see them, and are dropped again inside the step (the device lengths
are lowered by a pad count read from device memory, so the same graph serves every count of its bucket).  One graph
per bucket, all over the same cache memory; a bucket is captured on its second use (the first one compiles).

A single-token step may also be launched ahead of the forward that asks for it (``runtime.step_ahead``): when
:meth:`DecodeGraph.replay_ready` says the captured step can run as it is, :meth:`DecodeGraph.launch` replays it on
the caller's stream, and :meth:`DecodeGraph.take_back` undoes one nobody asked for (the cache one token shorter
again).

Steps take no attention mask: a left-padded batch is described to the cache once
(``PagedLatentCache.set_left_padding``) and the decode kernel skips each row's padding; other padding is moved to
the left after the prefill (``move_padding_left``).  A beam reorder between steps (``reorder_cache``) permutes the
static cache's block-table rows in place, so the captured step stays valid.  Not capturable, refused
with a clear error: caches with dynamic layers (Transformers' ``DynamicCache`` layers, a non-static paged cache)
and prefill (run it eagerly before the first step).
"""

from __future__ import annotations

import gc

import torch

from ..attention_interfaces.paged import MAX_STEP_TOKENS, mask_free_steps
from ..cache import CachePoolExhausted, PagedLatentCache, PagedLatentLayer
from ..compat import cache_keyword
from ..kernels.dispatch import graph_warmup


# the step's ids and positions copied into the graph's buffers in one multi-tensor launch rather than two copies
# (the same bytes; read at each replay: benchmarks flip it for a same-process A/B of the host time)
ONE_LAUNCH_INPUT_COPY = True


def step_bucket(tokens: int) -> int:
    """The token count a step of ``tokens`` per sequence runs as: 1, else the next power of two (at most 16)."""
    return 1 if tokens <= 1 else min(MAX_STEP_TOKENS, 1 << (tokens - 1).bit_length())


class _Bucket:
    """One captured step shape: its static inputs, its graph (None until captured) and its output."""

    __slots__ = ("ids", "positions", "graph", "logits")

    def __init__(self, ids, positions):
        self.ids, self.positions, self.graph, self.logits = ids, positions, None, None


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
    With ``T`` tokens per sequence (``[B, T]``, ``1 < T <= MAX_STEP_TOKENS``, paged layers only) it returns
    ``[B, T, vocab]``.
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
        self._buckets: dict[int, _Bucket] = {}  # per step size (step_bucket): static inputs and graph
        self._pool = None  # one memory pool for every bucket's graph (they never run at once)
        self._pad = None  # device int: how many of a step's tokens are bucket padding (dropped again in the step)
        self.captures = 0  # how many times a step was captured (once per bucket, unless a cache moved its memory)
        # memory layouts the steps ran on, counted with or without capture: on CUDA every layout after the one of
        # the first (eager) step is a capture, so this is what tells on a CPU that a reorder kept the graph valid
        self.layouts = 0
        self._addresses = self._seen = None
        self._batch = None
        self._stream = None  # the side stream of this step's warm-ups, captures and steps launched ahead (side_stream)
        self._check_layers()
        self._paged = [layer for layer in self.cache.layers if isinstance(layer, PagedLatentLayer)]
        self._other = [layer for layer in self.cache.layers if not isinstance(layer, PagedLatentLayer)]

    def side_stream(self) -> torch.cuda.Stream:
        """The one CUDA stream this step's warm-ups, captures and steps launched ahead (``runtime.step_ahead``) run
        on, drawn once: PyTorch hands out its pooled streams in turn, so a stream drawn per call would be a different
        one each time (after 32 draws one that another part of the model holds, such as the shared experts' side
        stream), and libraries that set up per-stream state at a warm-up would meet a stream they never saw while
        capturing."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

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

    def begin_call(self) -> tuple[int, int]:
        """A new ``generate`` call replays this graph (kept from an earlier one: ``runtime.kept_steps``): its layout
        count starts again; returns ``(captures, layouts)`` so far, to count the call's own."""
        self._seen = None
        return self.captures, self.layouts

    @property
    def takes_several_tokens(self) -> bool:
        """Whether steps of several tokens per sequence are possible: every cache layer paged (a state layer cannot
        take back the tokens a step writes beyond the real ones)."""
        return bool(self._paged) and len(self._paged) == len(self.cache.layers)

    @property
    def graph(self):
        """The single-token step's graph (None before it is captured)."""
        bucket = self._buckets.get(1)
        return None if bucket is None else bucket.graph

    def _check_step(self, batch: int, tokens: int = 1):
        """Every step: the cache was prefilled, holds this batch and has room for the step's ``tokens`` (a replay
        past a full static cache would write out of range).  Paged layers advance together, so their lengths are
        checked once where every layer holds the first one's (compared, not recomputed: this runs before every
        replay, while the GPU waits), and layer by layer otherwise."""
        paged = self._paged
        if paged:
            first = paged[0].host_lens  # (read, not copied)
            for layer in paged if any(layer.host_lens != first for layer in paged[1:]) else paged[:1]:
                lens = layer.host_lens
                longest = max(lens) if lens else 0
                if longest == 0:
                    raise RuntimeError(_NOT_PREFILLED)
                if len(lens) != batch:
                    raise ValueError(f"DecodeGraph: the cache holds {len(lens)} sequences, got a batch of {batch}")
                if longest + tokens > self.cache.max_seq_len:
                    raise CachePoolExhausted(
                        f"static paged latent cache sized for {self.cache.max_seq_len} tokens per sequence is full"
                    )
        for layer in self._other:
            started = getattr(layer, "has_previous_state", {})  # per state index
            values = list(started.values()) if isinstance(started, dict) else list(started)
            if not values or not all(values):
                raise RuntimeError(_NOT_PREFILLED)

    def _current_addresses(self):
        """What the memory of the step's cache layers looks like: paged layers by their ``layout_key`` (their moves,
        counted as they happen), other layers by every tensor's address."""
        return (tuple(layer.layout_key() for layer in self._paged),
                tuple(t.data_ptr() for layer in self._other for t in _layer_tensors(layer)))

    # ------------------------------------------------------------------ running
    def _forward(self, input_ids, position_ids):
        """One step as the model runs it; a step of several tokens drops its bucket padding again (device lengths
        lowered by ``self._pad``; the host lengths are the caller's)."""
        tokens = input_ids.shape[1]
        with mask_free_steps():
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=tokens,
                             **{self.keyword: self.cache})
        if tokens == 1:
            return out.logits[:, -1]
        for layer in self._paged:
            layer.seq_lens.sub_(self._pad)
        return out.logits

    def _capture(self, bucket: _Bucket):
        """Capture one step on the bucket's static buffers.  Capturing runs no kernel, so device state is untouched;
        the host state the captured Python advanced (paged host lengths) is put back.

        Python's cyclic garbage collector is off while capturing: a collection run by the forward's allocations
        would free whatever unreachable cycles hold at that moment, and freeing CUDA objects (another call's graph,
        an event) is a CUDA call the capture does not permit; PyTorch only warns of its error, and the capture,
        invalidated, fails at its next launch.  The cycles are collected later, outside the capture.  For the same
        reason the capture is thread-local: another thread that waits for the device meanwhile (a second
        ``generate``'s stop check on its own stream) does not invalidate it; this thread's calls are checked as
        always."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._capture_now(bucket)
        finally:
            if collecting:
                gc.enable()

    def _capture_now(self, bucket: _Bucket):
        saved = [layer.lengths for layer in self._paged]
        graph = torch.cuda.CUDAGraph()
        stream = self.side_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.stream(stream), torch.cuda.graph(graph, pool=self._pool, stream=stream,
                                                             capture_error_mode="thread_local"):
                bucket.logits = self._forward(bucket.ids, bucket.positions)
        finally:
            for layer, lens in zip(self._paged, saved):
                layer.rewind(lens)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        bucket.graph = graph
        self.captures += 1
        self._addresses = self._current_addresses()

    def _note_layout(self, addresses):
        """Count a step's memory layout when it differs from the last step's (``layouts``); returns ``addresses``."""
        if addresses != self._seen:
            self._seen = addresses
            self.layouts += 1
        return addresses

    def _padded(self, input_ids, position_ids, size: int):
        """The step's inputs grown to ``size`` tokens: copies of the last token at the following positions."""
        extra = size - input_ids.shape[1]
        if extra == 0:
            return input_ids, position_ids
        steps = torch.arange(1, extra + 1, device=position_ids.device, dtype=position_ids.dtype)
        return (torch.cat([input_ids, input_ids[:, -1:].expand(-1, extra)], dim=1),
                torch.cat([position_ids, position_ids[:, -1:] + steps], dim=1))

    def _eager(self, input_ids, position_ids, tokens: int, size: int):
        """A step run eagerly (no capture, or a bucket's first use), host lengths advanced by the real tokens."""
        if size > 1:
            self._pad.fill_(size - tokens)
        logits = self._forward(input_ids, position_ids).clone()
        if size > 1:
            for layer in self._paged:
                layer.rewind([n - (size - tokens) for n in layer.host_lens])
            logits = logits[:, :tokens]
        return logits

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2 or not 1 <= input_ids.shape[1] <= MAX_STEP_TOKENS:
            raise ValueError(f"DecodeGraph steps 1 to {MAX_STEP_TOKENS} tokens per sequence: input_ids must be "
                             f"[B, T], got {tuple(input_ids.shape)}")
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
        batch, tokens = input_ids.shape
        if tokens > 1 and not self.takes_several_tokens:
            raise ValueError("DecodeGraph: steps of several tokens need a cache of paged latent layers only (a "
                             "state layer cannot take back the tokens a step writes beyond the real ones)")
        size = step_bucket(tokens)
        if size > tokens:
            lens = self._paged[0].host_lens if self._paged else []
            if lens and max(lens) + size > self.cache.max_seq_len:
                size = tokens  # no room for the bucket's padding at the end of the cache: this count exactly
        self._check_step(batch, size)
        if self._batch is not None and self._batch != batch:
            raise ValueError(f"DecodeGraph was captured for a batch of {self._batch}, got {batch}")
        self._batch = batch
        addresses = self._note_layout(self._current_addresses())
        if size > 1 and self._pad is None:
            self._pad = torch.zeros((), dtype=self._paged[0].seq_lens.dtype, device=self._paged[0].seq_lens.device)
        input_ids, position_ids = self._padded(input_ids.to(self.device), position_ids.to(self.device), size)
        if not self.capture:
            return self._eager(input_ids, position_ids, tokens, size)
        bucket = self._buckets.get(size)
        if bucket is None:
            # a bucket's first step runs eagerly (on a side stream, as capture will): it compiles every Triton kernel
            # variant and initialises library workspaces, none of which may happen while capturing
            self._buckets[size] = _Bucket(torch.zeros_like(input_ids), torch.zeros_like(position_ids, dtype=torch.long))
            stream = self.side_stream()
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), graph_warmup():
                logits = self._eager(input_ids, position_ids, tokens, size)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            return logits
        if addresses != self._addresses:  # memory moved: no graph of the old layout may be replayed
            for other in self._buckets.values():
                other.graph = None
            self._pool = None  # (the dropped graphs' pool goes with them; a capture into its handle would fail)
        if bucket.graph is None:
            self._capture(bucket)
        self._replay(bucket, input_ids, position_ids, tokens, size)
        return bucket.logits.clone() if size == 1 else bucket.logits[:, :tokens].clone()

    def _replay(self, bucket: _Bucket, input_ids, position_ids, tokens: int, size: int) -> None:
        """The step's inputs copied into the bucket's buffers, its graph replayed (on the current stream), the host
        lengths advanced by the real tokens: ``bucket.logits`` holds the step's logits until the next replay."""
        if ONE_LAUNCH_INPUT_COPY:  # (host time here is time the GPU waits for in generate's loop)
            torch._foreach_copy_([bucket.ids, bucket.positions], [input_ids, position_ids], non_blocking=True)
        else:
            bucket.ids.copy_(input_ids, non_blocking=True)
            bucket.positions.copy_(position_ids, non_blocking=True)
        if size > 1:
            self._pad.fill_(size - tokens)
        bucket.graph.replay()
        for layer in self._paged:  # what the replayed kernels did on the device
            layer.advance(tokens)

    # ------------------------------------------------------------------ a step launched ahead (runtime.step_ahead)
    def replay_ready(self, batch: int) -> bool:
        """Whether a one-token step of ``batch`` sequences over paged layers only can run now exactly as the last
        one did: (with capture) its graph captured over the cache's current memory; the same batch; room for the
        token.  What :meth:`launch` needs; nothing is captured, compiled or checked loudly here."""
        if self._batch != batch or not self.takes_several_tokens:
            return False
        if self.capture:
            bucket = self._buckets.get(1)
            if bucket is None or bucket.graph is None or self._current_addresses() != self._addresses:
                return False
        try:
            self._check_step(batch, 1)
        except (RuntimeError, ValueError):  # (not prefilled, another batch, a full cache: the step itself will say)
            return False
        return True

    def launch(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One single-token step run now, on the current stream, after :meth:`replay_ready` said it can: the captured
        graph replayed, returning the graph's own logits buffer ``[B, vocab]`` (read it before the next step
        runs), or without capture the eager step (fresh logits)."""
        # (with capture, replay_ready has just read the addresses and found them the captured ones)
        self._note_layout(self._addresses if self.capture else self._current_addresses())
        if not self.capture:
            return self._eager(input_ids.to(self.device), position_ids.to(self.device), 1, 1)
        bucket = self._buckets[1]
        self._replay(bucket, input_ids, position_ids, 1, 1)
        return bucket.logits

    def take_back(self) -> None:
        """Undo the last single-token step, which nobody will read (a step launched ahead that the next forward
        did not ask for): every paged layer one token shorter on the device (on the current stream, ordered after
        the step) and on the host.  The row the step wrote stays in its page, past the length, unread, and the
        next step writes over it; a static cache's pages never move, so nothing else changes."""
        for layer in self._paged:
            layer.seq_lens.sub_(1)
            layer.rewind([n - 1 for n in layer.host_lens])
