"""The rotary call of a rewritten MLA forward, run on the rotary kernel once it is known what the call computes.

The rewrite (``rewrite.py``, edit (c)) turns ``q, k = f(q, k, *tables)`` into ``q, k = self._mla_fuser_rotary(f, q,
k, *tables)``.  Nothing is assumed from the function's name or source: ``f`` may be any function of that shape.
What it computes is read off its first call on a GPU (or under Triton's interpreter): its result is compared with
each recipe of ``kernels.rotary`` (torch twins of the rotaries Transformers writes) on the call's own inputs, and
the first recipe whose twin *and* kernel both agree with ``f`` up to the rounding of each value's terms
(``_agrees``) is kept for that kind of call (``f``, dtypes, rope width, table layout).  From then on such calls take one
kernel launch instead of ``f``'s 6-10.  No recipe agrees (another rotary, a scaled one, anything else), or a call
of another kind, or a call that cannot be checked: ``f`` itself runs, always.

When ``f`` runs instead: on CPU without the interpreter (``f``'s torch ops are what the reference would run
anyway), under ``torch.compile`` (the compiler fuses ``f`` itself), while autograd records (the kernel has no
backward), with keyword arguments or tensor subclasses (a DTensor, a fake tensor), and on a first call made while a CUDA graph is being captured (the check
needs to read results back; the next call outside a capture checks).
"""

from __future__ import annotations

import torch

from .kernels.dispatch import use_triton
from .kernels.rotary import RECIPES, rotary, rotary_problem, rotary_ref, table_width

ROTARY_ATTR = "_mla_fuser_rotary"


def recipe_tables(recipe: str, q: torch.Tensor, tables: tuple):
    """``(cos, sin)`` for the kernel from the call's table arguments, or None when they do not have the recipe's
    form: one complex64 ``[Bt, T, R/2]`` table for ``pairs_fp32``; ``cos, sin`` ``[Bt, T, R]`` in ``q``'s dtype for
    the other two (``pairs_to_halves`` reads the first halves)."""
    rope = q.shape[-1]
    if recipe == "pairs_fp32":
        if len(tables) != 1 or not isinstance(tables[0], torch.Tensor) or tables[0].dtype != torch.complex64:
            return None
        freqs = tables[0]
        if freqs.dim() != 3 or freqs.shape[-1] != table_width(recipe, rope):
            return None
        parts = torch.view_as_real(freqs)
        return parts[..., 0], parts[..., 1]
    if len(tables) != 2 or not all(isinstance(t, torch.Tensor) for t in tables):
        return None
    cos, sin = tables
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[-1] != rope or cos.dtype != q.dtype \
            or sin.dtype != q.dtype:
        return None
    if recipe == "pairs_to_halves":
        return cos[..., : rope // 2], sin[..., : rope // 2]
    return cos, sin


def _agrees(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> bool:
    """``got`` is ``want`` up to the rounding of the products and sums that make each value: within one unit of the
    output dtype's precision of the value itself plus twice the largest input of its row (a rotated value is
    ``a*c - b*s``, and a fused multiply-add or a complex product may round its terms differently; with
    cancellation that is many units of the small result, but never more than the terms' own rounding).  Another
    recipe, pairing or table differs by the size of the values themselves."""
    if not isinstance(want, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return False
    eps = torch.finfo(want.dtype).eps
    scale = x.float().abs().amax(dim=-1, keepdim=True)
    diff = (got.float() - want.float()).abs()
    return bool((diff <= eps * (want.float().abs() + 2 * scale) + torch.finfo(want.dtype).tiny).all())


class PendingJoin:
    """What a :meth:`RotaryCall.before_join` call left for the join after it: the call's kind, its query input
    (``source``), the rotated query it returned (``rope``), the joined query it also made (``joined``, None while the
    kind's width is not known) and the version counters then."""

    __slots__ = ("kind", "source", "rope", "joined", "version", "joined_version")

    def __init__(self, kind, source, rope, joined, version):
        self.kind, self.source, self.rope, self.joined, self.version = kind, source, rope, joined, version
        self.joined_version = None if joined is None else joined._version


def columns_before(q: torch.Tensor, width: int) -> torch.Tensor | None:
    """The ``width`` columns just before ``q``'s in the same rows of the same storage (a view), or None where there
    are none: ``q`` must have unit-stride rows and at least ``width`` elements of its storage before it.  What an
    MLA forward's ``torch.split(q, [nope, rope], -1)`` leaves as ``q_nope`` beside ``q_pe``."""
    if q.dim() == 0 or q.stride(-1) != 1 or q.storage_offset() < width:
        return None
    return q.as_strided((*q.shape[:-1], width), q.stride(), q.storage_offset() - width)


def _same_view(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return (b is not None and a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
            and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _join_operands(cat, args, kwargs):
    """``(first, second)`` of a ``torch.cat((first, second), dim=-1)`` call (the dim as ``-1`` or the last index,
    positional or keyword), else None."""
    if cat is not torch.cat or not args or len(args) > 2 or set(kwargs) - {"dim"} or (len(args) == 2 and kwargs):
        return None
    seq = args[0]
    dim = args[1] if len(args) == 2 else kwargs.get("dim", 0)
    if not isinstance(seq, (tuple, list)) or len(seq) != 2 or type(seq[1]) is not torch.Tensor:
        return None
    if type(dim) is not int or dim not in (-1, seq[1].dim() - 1):
        return None
    return seq[0], seq[1]


class RotaryCall:
    """``self._mla_fuser_rotary`` of one rewritten module: ``(f, q, k, *tables) -> f(q, k, *tables)``'s result,
    on the kernel for kinds of call whose recipe is known (module docstring).  ``verdicts``: kind -> recipe or
    None (checked: no recipe agrees)."""

    def __init__(self):
        self.verdicts: dict = {}
        self.nope_widths: dict = {}  # kind -> width of the query part joined before the rotated one (learnt)
        self.pending: PendingJoin | None = None  # the last before_join call's, for the join that follows it

    @staticmethod
    def _kind(fn, q, k, tables):
        return (fn, q.dtype, k.dtype, q.shape[-1], q.device.type,
                tuple((t.dtype, t.dim(), t.shape[-1]) if isinstance(t, torch.Tensor) else type(t) for t in tables))

    def __call__(self, fn, q, k, *tables, **kwargs):
        return self._call(fn, q, k, tables, kwargs, False)

    def before_join(self, fn, q, k, *tables, **kwargs):
        """``__call__`` for a call whose rotated query the forward only joins after its other part (the rewrite
        checked that its one use is ``torch.cat((q_nope, q_pe), dim=-1)``, now :meth:`join`): once a join showed
        where that other part lies (the columns just before the rotated ones, in the same rows), the kernel writes
        the joined query in the same launch and the rotated part is returned as a view of it."""
        return self._call(fn, q, k, tables, kwargs, True)

    def _call(self, fn, q, k, tables, kwargs, joinable):
        if (type(q) is not torch.Tensor or not use_triton(q) or kwargs  # (no subclasses: DTensor, fake)
                or type(k) is not torch.Tensor or torch.compiler.is_compiling()
                or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))):
            return fn(q, k, *tables, **kwargs)
        self.pending = None
        kind = self._kind(fn, q, k, tables)
        recipe = self.verdicts.get(kind, ...)
        if recipe is ...:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                return fn(q, k, *tables)  # the check reads results back: not inside a capture
            expected = fn(q, k, *tables)
            self.verdicts[kind], ran = self._identify(q, k, tables, expected)
            # the checking call returns what every later call of its kind will: the kernel's result once adopted
            # (a first call answered by f and later ones by the kernel would differ in the last bit)
            return expected if ran is None else ran
        if recipe is None:
            return fn(q, k, *tables)
        cos, sin = recipe_tables(recipe, q, tables)
        if rotary_problem(q, k, cos, sin, recipe) is not None:
            return fn(q, k, *tables)
        if not joinable or q.is_inference():  # (inference tensors keep no version counter: join cannot check)
            return rotary(q, k, cos, sin, recipe)
        width = self.nope_widths.get(kind)
        nope = None if width is None else columns_before(q, width)
        if nope is None:
            q_out, k_out = rotary(q, k, cos, sin, recipe)
            self.pending = PendingJoin(kind, q, q_out, None, q._version)
            return q_out, k_out
        joined, k_out = rotary(q, k, cos, sin, recipe, q_nope=nope)
        q_out = joined[..., width:]
        self.pending = PendingJoin(kind, q, q_out, joined, q._version)
        return q_out, k_out

    def join(self, cat, *args, **kwargs):
        """``cat(*args, **kwargs)`` (the forward's ``torch.cat((q_nope, q_pe), dim=-1)``), or the query the last
        :meth:`before_join` call already joined, when that is provably the same values: ``q_pe`` is the very tensor
        it returned, unchanged since (version counter), and ``q_nope`` the very memory it copied (same storage,
        offset, shape and strides: the columns before the rotated ones), unchanged since.  Anything else, or the
        first call of a kind (which only learns the width of ``q_nope`` from an adjacent one), runs ``cat``."""
        if torch.compiler.is_compiling():  # (before any state is touched: nothing of it for the compiler to trace)
            return cat(*args, **kwargs)
        pending, self.pending = self.pending, None
        parts = _join_operands(cat, args, kwargs)
        if pending is None or parts is None:
            return cat(*args, **kwargs)
        nope, rope = parts
        if rope is not pending.rope or type(nope) is not torch.Tensor or nope.is_inference():
            return cat(*args, **kwargs)
        width = nope.shape[-1] if nope.dim() == rope.dim() else 0
        same = (width > 0 and _same_view(nope, columns_before(pending.source, width))
                and nope._version == pending.version and pending.source._version == pending.version)
        if pending.joined is None:
            if same:
                self.nope_widths[pending.kind] = width
            return cat(*args, **kwargs)
        if same and width == pending.joined.shape[-1] - rope.shape[-1] and rope._version == pending.joined_version:
            return pending.joined
        return cat(*args, **kwargs)

    @staticmethod
    def _identify(q, k, tables, expected):
        """``(recipe, its kernel's result)`` for the recipe whose twin and kernel both give ``expected`` on these
        inputs, or ``(None, None)``."""
        if not (isinstance(expected, tuple) and len(expected) == 2):
            return None, None
        for recipe in RECIPES:
            found = recipe_tables(recipe, q, tables)
            if found is None or rotary_problem(q, k, *found, recipe) is not None:
                continue
            twin = rotary_ref(q, k, *found, recipe)
            if not all(_agrees(t, e, x) for t, e, x in zip(twin, expected, (q, k))):
                continue
            ran = rotary(q, k, *found, recipe)
            if all(_agrees(r, e, x) for r, e, x in zip(ran, expected, (q, k))):
                return recipe, ran
        return None, None
