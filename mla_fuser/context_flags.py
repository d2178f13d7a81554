"""Context flags that code compiled by ``torch.compile`` may read.

A few switches hold only inside a ``with`` block of ours: a CUDA-graph warm-up, the mask-free steps of a replayed
decode, generate's decode-time experts swap.  A ``contextvars.ContextVar`` is the right home for them eagerly (a
thread or task of its own sees its own value), but Dynamo in torch 2.11 cannot trace ``ContextVar.get`` and fails a
``fullgraph=True`` compile of any forward that reads one (torch 2.13 can).  A :class:`ContextFlag` keeps the
value in both places: the ContextVar, read eagerly, and a plain attribute, read while compiling.  Dynamo traces
that attribute like any global and guards on its value, so a compiled graph is reused only under the value it
was traced with, and a change compiles (or picks) the graph for the new one.

The attribute is the value of the innermost block entered by any thread: while one thread compiles inside a block
another thread is in too, the compiled code may see the other thread's value.  The flags kept here only choose
between kernels that compute the same result, so that mix can cost speed, never correctness.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch


class ContextFlag:
    """A value set for the extent of a ``with flag.set_to(value):`` block and read with :meth:`get`, eagerly and
    in code ``torch.compile`` traces."""

    def __init__(self, name: str, default):
        self._var = contextvars.ContextVar(f"mla_fuser_{name}", default=default)
        self.traced_value = default  # what compiled code reads (see the module docstring)

    def get(self):
        if torch.compiler.is_compiling():
            return self.traced_value
        return self._var.get()

    @contextlib.contextmanager
    def set_to(self, value):
        token = self._var.set(value)
        before, self.traced_value = self.traced_value, value
        try:
            yield
        finally:
            self._var.reset(token)
            self.traced_value = before

    def __repr__(self):
        return f"ContextFlag({self._var.name!r}, {self._var.get()!r})"
