"""``ContextFlag``: one value per ``with`` block, read the same eagerly and in code ``torch.compile`` traces with
``fullgraph=True`` (torch 2.11's Dynamo cannot trace ``ContextVar.get``: the flag must not call it there)."""

import threading

import torch

from mla_fuser.context_flags import ContextFlag


def test_a_flag_holds_its_value_inside_its_block_only_and_nested_blocks_restore_the_outer_one():
    flag = ContextFlag("test_nesting", 0)
    assert flag.get() == 0
    with flag.set_to(1):
        assert flag.get() == 1
        with flag.set_to(2):
            assert flag.get() == 2
        assert flag.get() == 1 and flag.traced_value == 1
    assert flag.get() == 0 and flag.traced_value == 0


def test_the_value_is_restored_when_the_block_raises():
    flag = ContextFlag("test_raise", False)
    try:
        with flag.set_to(True):
            raise KeyError("inside")
    except KeyError:
        pass
    assert flag.get() is False and flag.traced_value is False


def test_eagerly_another_thread_sees_its_own_value():
    flag = ContextFlag("test_threads", "outer")
    seen = []
    with flag.set_to("main"):
        worker = threading.Thread(target=lambda: seen.append(flag.get()))
        worker.start()
        worker.join(timeout=30)
    assert seen == ["outer"]


def test_a_fullgraph_compiled_function_reads_the_value_of_the_block_it_runs_in():
    """Compiled code must not call ContextVar.get (the traced attribute instead), and a graph traced under one
    value must not be replayed under another (Dynamo guards on the attribute): each call returns its block's
    answer."""
    flag = ContextFlag("test_compiled", frozenset())
    key = 7

    @torch.compile(fullgraph=True, backend="eager")
    def step(x):
        return x + 1 if key in flag.get() else x - 1

    x = torch.zeros(3)
    assert torch.equal(step(x), x - 1)
    with flag.set_to(frozenset({key})):
        assert torch.equal(step(x), x + 1)
    assert torch.equal(step(x), x - 1)
    with flag.set_to(frozenset({key, 9})):
        assert torch.equal(step(x), x + 1)


def test_while_compiling_the_context_variable_is_not_read(monkeypatch):
    """What torch 2.11 needs (its Dynamo fails on ContextVar.get): with compilation reported, get() answers from
    the traced attribute even where the ContextVar would answer otherwise."""
    flag = ContextFlag("test_no_var", False)
    with flag.set_to(True):
        flag.traced_value = "traced"  # (only to tell the two sources apart)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert flag.get() == "traced"
        monkeypatch.undo()
        assert flag.get() is True
