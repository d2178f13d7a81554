"""A Transformers cache the caller passes to a fused model's ``generate``: whether the call converts it, and the copies
into and out of the call's own cache.

Why: a graphed call runs on a static paged cache (fixed addresses, latent pages).  A caller who passes Transformers'
own ``DynamicCache`` or ``StaticCache`` (often the one the previous turn of a chat filled) would otherwise get eager
decode steps, an order of magnitude slower on a GPU.  Such a cache is converted instead: the tokens it already holds
are written into the call's static paged cache before the call (:func:`take_in`: their latent rows, through the paged
layers' own ``update``), the call runs graphed, and what the call added is appended to the caller's cache through
its own ``update`` when the call returns (:func:`fill`), so it ends holding what native's steps would have written
there, in its own tensors.

Converted: a ``DynamicCache`` of full-attention ``DynamicLayer`` layers, not offloaded; a ``StaticCache`` of
``StaticLayer`` layers, not offloaded, with room for every token the call writes and, where a layer is allocated
already, the call's rows.  A cache that already holds tokens also needs every layer holding as many, one row per
sequence of the call (no beams or several returned sequences: Transformers' own expansion of a filled cache is not
repeated here), no verification steps (assisted or prompt-lookup decoding) and prompt tokens past the held ones.
Anything else runs as given (eager steps, Transformers' own checks and errors); :func:`refusal` says why.
"""

from __future__ import annotations


def held_tokens(cache) -> int:
    """Tokens the caller's cache holds now (its first layer's count)."""
    return int(cache.get_seq_length())


def refusal(cache, shape) -> str:
    """Why the caller's ``cache`` runs as given, or "" when the call converts it.  ``shape``: the call's
    ``generate.CallShape`` (rows, prompt and final lengths, verification steps)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache, StaticLayer

    kind = type(cache)
    layer_type = DynamicLayer if kind is DynamicCache else StaticLayer if kind is StaticCache else None
    if layer_type is None:
        return (f"a {kind.__name__} passed by the caller runs as given (eager steps; Transformers may compile the "
                f"forward over a compileable cache)")
    name = kind.__name__
    if getattr(cache, "offloading", False) or any(type(layer) is not layer_type for layer in cache.layers):
        return f"an offloaded or sliding-window {name} runs as given (eager steps)"
    if kind is StaticCache:
        why = _static_room(cache, shape)
        if why:
            return why
    held = held_tokens(cache)
    if held == 0:
        if kind is StaticCache and shape.verifies:
            return "a StaticCache with assisted or prompt-lookup decoding runs as given (Transformers' own checks)"
        return ""
    if shape.verifies:
        return f"a {name} that already holds tokens, with assisted or prompt-lookup decoding, runs as given"
    if shape.beams > 1 or shape.batch != _rows(cache):
        return (f"a {name} holding tokens of {_rows(cache)} rows, for a call of {shape.batch} rows (prompts times "
                f"beams or returned sequences), runs as given (eager steps)")
    if any(int(layer.get_seq_length()) != held for layer in cache.layers):
        return f"a {name} whose layers hold different numbers of tokens runs as given (eager steps)"
    if shape.prompt <= held:
        return f"a {name} holding {held} tokens, for a prompt of {shape.prompt}, runs as given"
    return ""


def _rows(cache) -> int:
    keys = cache.layers[0].keys
    return -1 if keys is None else keys.shape[0]


def _static_room(cache, shape) -> str:
    written = shape.length - 1  # (the last token is never fed back)
    for layer in cache.layers:
        if layer.max_cache_len < written:
            return (f"a StaticCache of max_cache_len={layer.max_cache_len} cannot hold the {written} tokens the call "
                    f"writes: it runs as given (Transformers' own error)")
        if layer.is_initialized and layer.keys.shape[0] != shape.batch:
            return (f"a StaticCache allocated for {layer.keys.shape[0]} rows, for a call of {shape.batch} rows, runs "
                    f"as given (eager steps)")
    return ""


def take_in(caller, ours, held: int) -> None:
    """The ``held`` tokens of every layer of the caller's cache written into ``ours`` (the call's static paged cache,
    empty): the prompt's prefill then reads them as its cached prefix."""
    for idx, layer in enumerate(caller.layers):
        ours.update(layer.keys[:, :, :held], layer.values[:, :, :held], idx)


def fill(caller, ours, held: int) -> None:
    """What the call added to ``ours`` after the ``held`` tokens it started from, appended to the caller's cache
    through its own ``update`` (in native's layout)."""
    for idx, layer in enumerate(ours.layers):
        both = getattr(layer, "keys_and_values", None)  # (a paged layer: its pages read back once, not per property)
        keys, values = both() if both is not None else (layer.keys, layer.values)
        if keys is not None and keys.shape[2] > held:
            caller.update(keys[:, :, held:], values[:, :, held:], idx)
