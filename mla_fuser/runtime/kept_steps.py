"""A graphed ``generate()``'s static cache and captured decode step, kept for the model's next call of the same shape.

Why: every graphed call built its own static paged cache and ``DecodeGraph``, so besides its prefill each call paid one
eager decode step (it compiles and warms up what a capture may not do) and one capture: about 0.14 s on an H200 at
B=1 L=512, the time of ~60 replayed steps, paid again by every call of a user who generates one prompt at a time.
Now the call keeps both when it returns, and the next call whose cache would have the same shape takes them back:
the cache emptied with every buffer where it was (``PagedLatentCache.restart``), so the kept graph replays from the
first decode step.  Like Transformers' own static cache (``model._cache``), the memory stays held between calls;
:func:`release_decode_graphs` frees it, ``MLA_FUSER_REUSE_DECODE_GRAPHS=0`` turns keeping off.

The shape (:func:`step_key`): batch rows, cache size (the call's tokens rounded up to ``SIZE_STEP``, so calls with
prompts of nearby lengths share it), left padding or none (a captured step reads the padding starts or not), the
device.  Calls whose padding is moved to the left after the prefill (right or inner padding) are not kept.

Never reused on a model that changed since the capture, because the graph replays what the forward did then
(:func:`model_fingerprint`): a parameter or buffer at another address (``.to()``, a replaced weight, adapters
injected), forward hooks added or removed, train/eval mode, the attention implementation, PEFT adapters switched,
merged or disabled, autocast.  Weights updated in place (an optimizer step, ``load_state_dict``) are read by the
replay as they are.  A cache the call's output carries (``return_dict_in_generate=True``) belongs to the caller and
is not kept.  One kept step per model, taken out while a call uses it, so concurrent calls never share one.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from .. import envs
from ..compat import attention_implementation
from ..plans import model_state

# a kept cache's size is the call's tokens rounded up to this (calls with nearby lengths share one)
SIZE_STEP = 256
# module attributes that say which PEFT adapters a tuner layer runs (changed without touching any parameter)
_ADAPTER_STATE = ("active_adapters", "disable_adapters", "merged_adapters")
# taking a kept step out is one read and one write of the model's state: two threads calling generate at once must
# never both get it
_LOCK = threading.Lock()


@dataclass
class KeptStep:
    key: tuple
    fingerprint: tuple
    cache: object  # the static PagedLatentCache
    graph: object  # the DecodeGraph captured over it


def cache_size(tokens: int) -> int:
    """The size of a kept cache for a call of up to ``tokens`` tokens per sequence."""
    return -(-tokens // SIZE_STEP) * SIZE_STEP


def step_key(model, batch: int, tokens: int, padding, left_padded: bool) -> tuple | None:
    """What a kept step must match for a call of ``batch`` rows of up to ``tokens`` tokens (``padding``: the call's
    mask when it pads, ``left_padded``: all of it on the left); None when such a call is not kept."""
    if not envs.reuse_decode_graphs() or (padding is not None and not left_padded):
        return None
    device = model.get_input_embeddings().weight.device
    return batch, cache_size(tokens), padding is not None, str(device)


def model_fingerprint(model) -> tuple:
    """What the captured step depends on besides the values in its tensors (see the module docstring)."""
    tensors = tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))
    modules = []
    for index, module in enumerate(model.modules()):
        hooks = (tuple(module._forward_hooks), tuple(module._forward_pre_hooks))
        adapters = None
        if hasattr(type(module), "active_adapters"):  # a PEFT tuner layer
            adapters = tuple(_frozen(getattr(module, name, None)) for name in _ADAPTER_STATE)
        if module.training or adapters is not None or hooks != ((), ()):
            modules.append((index, module.training, hooks, adapters))
    from torch.nn.modules import module as nn_module

    global_hooks = (tuple(nn_module._global_forward_hooks), tuple(nn_module._global_forward_pre_hooks))
    autocast = tuple((torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in ("cuda", "cpu"))
    return tensors, tuple(modules), global_hooks, autocast, attention_implementation(model)


def _frozen(value):
    return tuple(value) if isinstance(value, (list, tuple, set)) else value


def _taken_out(model) -> KeptStep | None:
    """The model's kept step, if any, no longer kept."""
    state = model_state(model)
    with _LOCK:
        kept, state.kept_step = state.kept_step, None
    return kept


def take(model, key: tuple | None, fingerprint: tuple | None = None):
    """``(cache, graph)`` kept by the model's last graphed call when ``key`` and the model still match (the cache
    emptied, its memory where it was), else None; either way nothing stays kept (a mismatch frees it).
    ``fingerprint``: the model's :func:`model_fingerprint` when the caller has it (one reading per call)."""
    kept = _taken_out(model)
    if kept is None or key is None or kept.key != key:
        return None
    if kept.fingerprint != (model_fingerprint(model) if fingerprint is None else fingerprint):
        return None
    if not kept.cache.restart():
        return None
    return kept.cache, kept.graph


def keep(model, key: tuple | None, cache, graph, fingerprint: tuple | None = None) -> bool:
    """Keep ``cache`` and ``graph`` for the model's next call of shape ``key`` (None: not kept); ``fingerprint`` as
    for :func:`take` (read at the start of the call: the call itself changes nothing it covers)."""
    if key is None or not envs.reuse_decode_graphs():
        return False
    kept = KeptStep(key, model_fingerprint(model) if fingerprint is None else fingerprint, cache, graph)
    with _LOCK:
        model_state(model).kept_step = kept
    return True


def release_decode_graphs(model) -> bool:
    """Free the static cache and captured decode step ``model``'s last graphed ``generate()`` kept (they are freed
    once nothing else holds them; ``torch.cuda.empty_cache()`` then returns the memory to the device).  True when
    something was kept."""
    return _taken_out(model) is not None
