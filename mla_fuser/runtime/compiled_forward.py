"""A ``generate()`` call of a fused model whose forward the caller compiled (``model.forward = torch.compile(...)``,
or ``model.compile(...)``, PyTorch's own method for a module: the same habit by another name, ``_CompiledSlot``).

Transformers' docs show the habit as ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` with
``cache_implementation="static"``.  Our own CUDA graph cannot capture around a compiled forward (a compile, or its
own CUDA-graph recording, cannot run inside a capture), so such a call leaves the decode steps to the compiled
forward, over a static paged cache (``generate.plan_generate``).  Four things make that work as the habit expects:

* **The prefill runs uncompiled** (:func:`prefill_uncompiled`): the first forward allocates the cache's page pools
  and writes the prompt through host-side bookkeeping that ``fullgraph=True`` cannot trace (it raised), and a
  compiled prefill would be compiled again for every prompt length.  Transformers' own compiled generation never
  compiles its prefill either (``_prefill`` calls the module, the decode steps the compiled call).
* **Left padding only**: a compiled step cannot branch on its mask, so it asserts left padding on the device
  (``attention_interfaces.vllm_mla.left_padding_of``), which would end the process's CUDA context; a call whose
  prompt is padded otherwise runs as if the forward were not compiled (:func:`forward_uncompiled`; graphed where it
  can be), and its plan's reason says so.
* **One shape at every step**: the static paged cache reports ``is_compileable`` from the call's first decode step
  on (``PagedLatentCache.set_compileable``), as Transformers' ``StaticCache`` does, so Transformers builds each step's
  mask at the cache's full length, and a traced step neither reads nor changes the host's lengths (a Python int
  read there would be guarded on, and each new value would trace the step again, with symbolic sizes whose every
  value ``reduce-overhead`` records a CUDA graph for: 22-30 ms a step measured on an H100 before this, against 3
  for our own replayed step).  The host lengths are advanced here after each compiled step instead.  The call sets
  ``disable_compile``, a safeguard: Transformers decides whether to compile its steps before the prefill, when the
  cache is not compileable yet, and compiling them would wrap a second compile around the caller's.
* **The cache's buffers are static addresses** (:func:`mark_static_addresses`): ``mode="reduce-overhead"`` records
  CUDA graphs (cudagraph trees) that copy every tensor input which is not a parameter, a buffer or marked static
  into their own memory before each replay, and do not record at all when such an input is written in place: the
  page pools and tables a decode step reads and appends to must be marked, as Transformers' ``StaticCache`` marks its
  keys and values.  Marked tensors are guarded by identity, so a new cache per call would mean a new compile per
  call: the plan keeps its static cache for the model's next call of the same shape (``kept_steps``), as Transformers
  keeps ``model._cache``.

The tensors marked are those a paged layer lists as the memory its steps read (``_WATCHED``, which the cache counts
moves of for our own graphs: ``cache_moves``); the cache itself knows nothing of compilation.
"""

from __future__ import annotations

import contextlib
import inspect
import types

import torch

from ..attention_interfaces.paged import MAX_STEP_TOKENS
from ..cache import CachePoolExhausted
from ..cache_moves import CountsMoves

COMPILED_BY_CALLER = ("the caller compiled the model's forward (torch.compile, or model.compile()): its own compiled "
                      "steps run (with mode='reduce-overhead', its own CUDA graphs); ours would capture around them")


PADDING_NOT_COMPILED = ("the caller compiled the model's forward, but a compiled decode step reads left padding only "
                        "(its mask cannot move the padding): this call ran the forward as it was before compiling")


def module_compiled(model) -> bool:
    """Whether the caller compiled the module itself (``model.compile(...)``, PyTorch's own method): its calls then
    run a ``torch.compile`` of ``nn.Module._call_impl``, which calls the class's forward (and the module's hooks)."""
    return "forward" not in model.__dict__ and getattr(model, "_compiled_call_impl", None) is not None


def caller_compiled_forward(model) -> bool:
    """Whether the instance's ``forward`` is a ``torch.compile`` of it (``model.forward = torch.compile(
    model.forward, ...)``, a common habit), or the module was compiled (:func:`module_compiled`)."""
    forward = model.__dict__.get("forward")
    if forward is None:
        return module_compiled(model)
    return hasattr(forward, "_torchdynamo_orig_callable") or bool(getattr(forward, "_is_torch_compile", False))


def uncompiled_forward(model):
    """The forward the caller compiled, bound to ``model``, when it is the class's own (``model.forward =
    torch.compile(model.forward, ...)``), or the module's uncompiled call (``model._call_impl``) when the module was
    compiled; None for anything else (a function of the caller's, compiled)."""
    if module_compiled(model):
        return model._call_impl
    compiled = model.__dict__.get("forward")
    original = getattr(compiled, "_torchdynamo_orig_callable", None)
    own = getattr(type(model), "forward", None)
    if inspect.ismethod(original):
        return original if original.__self__ is model and original.__func__ is own else None
    return types.MethodType(original, model) if original is not None and original is own else None


class _CompiledSlot:
    """Where the caller's compiled call lives on ``model``: the instance's ``forward`` (``model.forward =
    torch.compile(...)``) or, for a compiled module, the attribute ``nn.Module.__call__`` runs instead of
    ``_call_impl`` (``_compiled_call_impl``); both are instance attributes.  ``put`` installs a callable there for
    one call, ``put_uncompiled`` what makes the calls uncompiled, ``restore`` puts the caller's back."""

    def __init__(self, model):
        self.model = model
        self.name = "_compiled_call_impl" if module_compiled(model) else "forward"
        self.compiled = model.__dict__[self.name]

    def put(self, call) -> None:
        setattr(self.model, self.name, call)

    def put_uncompiled(self) -> None:
        """The forward as it was before compiling; for a compiled module, no compiled call (``__call__`` then runs
        ``_call_impl``)."""
        self.put(uncompiled_forward(self.model) if self.name == "forward" else None)

    def restore(self) -> None:
        setattr(self.model, self.name, self.compiled)


@contextlib.contextmanager
def prefill_uncompiled(model, cache):
    """For one call over ``cache``: the forwards that feed a prompt (the call's first, and any of more than
    ``MAX_STEP_TOKENS`` tokens per row: prefill chunks) run the forward as it was before compiling, and the buffers
    they leave in ``cache`` are marked static (:func:`mark_static_addresses`); the decode steps run the compiled one,
    as do verification steps (assisted / prompt-lookup decoding) of up to ``MAX_STEP_TOKENS`` tokens over a cache that
    is not static.  Over a static cache those run uncompiled, the cache not compileable meanwhile: a traced step of
    several tokens would read the latent back up to a length it cannot know without a host read (``fullgraph=True``
    raised on that branch), and their token count changes from step to step (each count a compile of its own).
    The outputs are the same; the caller's compiled forward is put back when the call returns."""
    slot = _CompiledSlot(model)
    compiled = slot.compiled
    original = uncompiled_forward(model)
    calls = [0]
    layers = cache.paged
    fixed = cache.static and bool(layers)  # (one shape at every step: see the module docstring)

    def forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        first = calls[0] == 0
        calls[0] += 1
        if first or tokens is None or tokens > (1 if fixed else MAX_STEP_TOKENS):
            if fixed:  # (a prefill's mask at the cache's full length would be larger; see the docstring)
                cache.set_compileable(False)
            out = original(*args, **kwargs)
            mark_static_addresses(cache)
            if fixed:
                cache.set_compileable(True)
            return out
        if not fixed:
            return compiled(*args, **kwargs)
        _check_room(cache, layers, tokens)
        before = [layer.host_lens for layer in layers]
        out = compiled(*args, **kwargs)
        for layer, lens in zip(layers, before):
            # a traced update advanced the lengths on the device only; one that ran eagerly (Dynamo disabled, as by
            # TORCHDYNAMO_DISABLE=1, or falling back on a frame) set new host lengths itself: advancing those again
            # would put the next step's tokens past the end
            if layer.host_lens is lens:
                layer.advance(tokens)
        return out

    slot.put(forward)
    try:
        yield
    finally:
        slot.restore()
        if fixed:
            cache.set_compileable(False)


def _check_room(cache, layers, tokens: int) -> None:
    """What an uncompiled step of a static cache raises when the pages of its paged ``layers`` cannot hold ``tokens``
    more (a compiled step would write past them)."""
    room = cache.max_seq_len - max(max(layer.host_lens, default=0) for layer in layers)
    if tokens > room:
        raise CachePoolExhausted(f"static paged latent cache sized for {cache.max_seq_len} tokens per sequence; "
                                 f"a compiled step of {tokens} tokens finds room for {max(room, 0)}")


@contextlib.contextmanager
def forward_uncompiled(model):
    """For one call: the instance's forward is the one the caller compiled, uncompiled (a batch padded other than on
    the left: a compiled step asserts left padding on the device, so it would fail, and the call's own plan moves
    such padding in the cache instead).  The compiled forward is put back when the call returns."""
    slot = _CompiledSlot(model)
    slot.put_uncompiled()
    try:
        yield
    finally:
        slot.restore()


def step_tensors(owner) -> list[torch.Tensor]:
    """The tensors ``owner`` (a cache class that counts its moves) lists as the memory its steps read, through the
    objects it holds that count theirs (a layer's page pool)."""
    found = []
    for name in sorted(type(owner)._WATCHED):
        value = owner.__dict__.get(name)
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif isinstance(item, CountsMoves):
                found.extend(step_tensors(item))
    return found


def mark_static_addresses(cache) -> int:
    """Mark the tensors the decode steps of ``cache``'s paged layers read as static addresses for
    ``torch.compile`` (see the module docstring); returns how many were marked (each once)."""
    seen = set()
    for layer in cache.paged:
        for tensor in step_tensors(layer):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                torch._dynamo.mark_static_address(tensor)
    return len(seen)
