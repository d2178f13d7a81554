"""Shared experts on a second CUDA stream, beside the routed experts, in captured steps.

A DeepSeek-style MoE block computes ``experts(route(x)) + shared(x)``: the shared experts read only the block's input,
yet the model runs them after the routed experts, on one stream.  In a small decode step neither branch fills the GPU
(the B=1 step of a V2-Lite-shaped model spends ~35 us per layer in the routed GEMVs and ~17 us in five launches of
the shared MLP), so running them side by side saves most of the shorter one.  In a CUDA graph a second stream is a
parallel branch of the graph: the replay pays nothing for it.  Eager launches would pay host time for the events, so
only captured steps (``kernels.dispatch.launches_are_free``: a capture, or the eager warm-up step before it) overlap.

How, without touching the block's forward: a forward pre-hook on the block records an event on the current stream
when the block starts (its input is ready) and remembers the input's storage until the block returns; a pre-hook on
each shared expert that the match found reading the block's input (``SharedExpert``) checks that the tensor it gets
is that input (same storage, a view of it included), makes a side stream wait for the event and makes it current; its
forward hook (``always_call``: it runs when the MLP raises, too) makes the block's stream current again and has it
wait for the side stream, so whatever the block does with the shared output (the add) comes after the shared work.
The match accounts for every op of the block (it fails closed), and none writes the block's input in place, so the
input the side stream reads is the one the event covers.  (Making the side stream wait for the router instead, so
that the router's few-row kernels run alone, measured slower on an H200: 2.29 against 2.35 ms per B=1 step of the
FP8 V2-Lite-shaped model, 2.71 against 2.84 in bf16, ``profile_decode_step_*_fork.json``; and at 16 rows
it gained nothing on an H100: 10.177 against 10.173 ms per replay of the 16x1024 bf16 step.)  Anything else (a
different tensor, CPU, a compiled region, ``MLA_FUSER_OVERLAP_SHARED_EXPERTS=0``) runs as before, on one stream.
The kernels are the same ones either way, so the results are bitwise the same.  On a machine without CUDA no hooks
are attached (they would cost each MoE call a few microseconds for nothing: ~2.5% of the tiny preset's CPU decode).

Memory: the shared MLP's own tensors are allocated on the side stream and freed there; its output is marked as used
by the block's stream (``record_stream``); the block's input, read on the side stream, is only freed after the join.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ... import envs
from ...kernels.dispatch import launches_are_free
from ...plans import plan_of, set_plan
from .specs import MoEMatch


class _CudaStreams:
    """The CUDA stream calls the hooks make (a seam the CPU tests replace with a recorder)."""

    def __init__(self):
        self._side = {}

    def handles(self, x: Tensor) -> bool:
        return x.is_cuda

    def side(self, device: torch.device):
        stream = self._side.get(device)
        if stream is None:
            stream = self._side[device] = torch.cuda.Stream(device)
        return stream

    def record_event(self, device: torch.device):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def current(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def set_current(self, stream) -> None:
        torch.cuda.set_stream(stream)

    def used_on(self, t: Tensor, stream) -> None:
        t.record_stream(stream)


STREAMS = _CudaStreams()


class SharedOverlapPlan:
    """One block's overlap state, shared by the block's hooks and its shared experts' hooks."""

    def __init__(self, shared: tuple[str, ...]):
        self.shared = shared  # the shared experts' names that read the block's input
        self.started = None  # (storage pointer, device, event) while the block runs, else None
        self.switched = None  # (block's stream, side stream, device) while a shared expert runs on the side stream
        self.overlapped_calls = 0  # shared-expert calls run on the side stream (diagnostics, tests)
        self.handles = []


def _wanted(x) -> bool:
    return (isinstance(x, Tensor) and STREAMS.handles(x) and launches_are_free()
            and envs.get("MLA_FUSER_OVERLAP_SHARED_EXPERTS"))


# (each hook returns first thing under torch.compile: a traced region keeps one stream and touches no plan state)


def _block_starts(block: nn.Module, args) -> None:
    if torch.compiler.is_compiling():
        return
    plan = plan_of(block, "shared_overlap")
    plan.started = None
    if plan.switched is not None or not args or not _wanted(args[0]):
        return
    x = args[0]
    plan.started = (x.untyped_storage().data_ptr(), x.device, STREAMS.record_event(x.device))


def _block_ends(block: nn.Module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    plan_of(block, "shared_overlap").started = None  # (a later call of a shared expert alone never waits on it)


def _shared_starts(shared: nn.Module, args) -> None:
    if torch.compiler.is_compiling():
        return
    plan = plan_of(shared, "shared_overlap")
    started = plan.started
    if started is None or plan.switched is not None or not args or not _wanted(args[0]):
        return
    x = args[0]
    pointer, device, event = started
    if x.device != device or x.untyped_storage().data_ptr() != pointer:
        return  # (not the block's input: the side stream would not wait for what produced it)
    main, side = STREAMS.current(device), STREAMS.side(device)
    side.wait_event(event)
    STREAMS.set_current(side)
    plan.switched = (main, side, device)
    plan.overlapped_calls += 1


def _shared_ends(shared: nn.Module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    plan = plan_of(shared, "shared_overlap")
    switched, plan.switched = plan.switched, None
    if switched is None:
        return
    main, side, device = switched
    STREAMS.set_current(main)
    main.wait_stream(side)
    if isinstance(output, Tensor) and output.device == device:  # (a layer moved to another device made it there)
        STREAMS.used_on(output, main)


def cuda_present() -> bool:
    return torch.cuda.is_available()


def attach_shared_overlap(block: nn.Module, match: MoEMatch) -> str:
    """Hooks that run this block's shared experts on a side stream in captured steps; says what was done ("" when the
    block has no shared expert reading its input, or the machine no CUDA device)."""
    names = tuple(s.mlp for s in match.shared)
    if not names or not cuda_present():
        return ""
    if plan_of(block, "shared_overlap") is not None:
        return "shared experts on a side stream in captured steps (already)"
    plan = SharedOverlapPlan(names)
    set_plan(block, "shared_overlap", plan)
    plan.handles.append(block.register_forward_pre_hook(_block_starts))
    plan.handles.append(block.register_forward_hook(_block_ends, always_call=True))
    for name in names:
        shared = block.get_submodule(name)
        set_plan(shared, "shared_overlap", plan)
        plan.handles.append(shared.register_forward_pre_hook(_shared_starts))
        plan.handles.append(shared.register_forward_hook(_shared_ends, always_call=True))
    return "shared experts on a side stream in captured steps"
