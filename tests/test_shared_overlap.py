"""Shared experts on a side CUDA stream in captured steps (``fusers.moe.shared_overlap``).

On a CPU the stream calls go to a recorder (``shared_overlap.STREAMS`` is the seam) and "launches are free" is forced,
so what is checked is the handshake: which calls switch streams, in which order the block's stream and the side stream
wait for each other, and that nothing else switches (a shared expert called on another tensor or outside its block,
launches that cost host time, the switch off, a shared MLP that raises).  The GPU test (``test_gpu.py``) checks that a
replayed step with the overlap gives the same logits, bit for bit, as one without.
"""

from __future__ import annotations

import pytest
import torch

from mla_fuser.fusers.moe import shared_overlap
from mla_fuser.plans import plan_of
from test_moe_fuser import Block, H, Knot, Pipe, Stack, _fuse_block


class _Stream:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def wait_event(self, event):
        self.calls.append((self.name, "waits for", event))

    def wait_stream(self, other):
        self.calls.append((self.name, "waits for", other.name))


class _Recorder:
    """Stands in for the CUDA stream calls: CPU tensors count as CUDA ones; every call is recorded."""

    def __init__(self):
        self.calls = []
        self.main = self.now = _Stream("main", self.calls)
        self.side_stream = _Stream("side", self.calls)

    def handles(self, x):
        return True

    def side(self, device):
        return self.side_stream

    def record_event(self, device):
        self.calls.append(("event on", self.now.name))
        return "input ready"

    def current(self, device):
        return self.now

    def set_current(self, stream):
        self.calls.append(("current", stream.name))
        self.now = stream

    def used_on(self, t, stream):
        self.calls.append(("output used on", stream.name))


OVERLAPPED = [("event on", "main"), ("side", "waits for", "input ready"), ("current", "side"), ("current", "main"),
              ("main", "waits for", "side"), ("output used on", "main")]


@pytest.fixture(autouse=True)
def _cuda_present(monkeypatch):
    """Fusion attaches the hooks only where CUDA is present: here it is said to be."""
    monkeypatch.setattr(shared_overlap, "cuda_present", lambda: True)


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(shared_overlap, "STREAMS", rec)
    monkeypatch.setattr(shared_overlap, "launches_are_free", lambda: True)
    return rec


def _fused(block):
    row = _fuse_block(block)
    return block, row


@pytest.mark.parametrize("make", [lambda: Block(shared=Knot(24)), lambda: Block(shared=Knot(24), gated=True),
                                  lambda: Block(shared=Pipe()), lambda: Stack(shared=True)],
                         ids=["glu", "gated", "plain", "module_list"])
def test_a_block_s_shared_expert_runs_on_the_side_stream_between_the_two_waits(recorder, make):
    block, row = _fused(make())
    assert "shared experts on a side stream in captured steps" in row.reason
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        expected = block(x)  # (recorded too: the recorder does nothing to the computation)
        recorder.calls.clear()
        got = block(x)
    assert recorder.calls == OVERLAPPED
    assert recorder.now is recorder.main and torch.equal(got, expected)
    assert plan_of(block, "shared_overlap").overlapped_calls == 2


def test_a_block_without_shared_experts_gets_no_hooks(recorder):
    block, row = _fused(Block())
    assert plan_of(block, "shared_overlap") is None and "side stream" not in row.reason
    assert not block._forward_pre_hooks
    with torch.no_grad():
        block(torch.randn(2, 5, H))
    assert recorder.calls == []


def test_no_hooks_without_cuda(monkeypatch):
    monkeypatch.setattr(shared_overlap, "cuda_present", lambda: False)
    block, row = _fused(Block(shared=Knot(24)))
    assert plan_of(block, "shared_overlap") is None and not block._forward_pre_hooks and "side stream" not in row.reason


def test_nothing_switches_when_launches_cost_host_time_or_the_switch_is_off(recorder, monkeypatch):
    block, _ = _fused(Block(shared=Knot(24)))
    x = torch.randn(2, 5, H)
    monkeypatch.setattr(shared_overlap, "launches_are_free", lambda: False)  # (an eager step)
    with torch.no_grad():
        block(x)
    assert recorder.calls == []
    monkeypatch.setattr(shared_overlap, "launches_are_free", lambda: True)
    monkeypatch.setenv("MLA_FUSER_OVERLAP_SHARED_EXPERTS", "0")
    with torch.no_grad():
        block(x)
    assert recorder.calls == []
    monkeypatch.setenv("MLA_FUSER_OVERLAP_SHARED_EXPERTS", "1")
    with torch.no_grad():
        block(x)
    assert recorder.calls == OVERLAPPED


def test_a_shared_expert_called_alone_or_on_another_tensor_stays_on_its_stream(recorder):
    block, _ = _fused(Block(shared=Knot(24)))
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        block(x)
        recorder.calls.clear()
        block.common(x)  # (after the block returned: the same storage, but nothing waits for it any more)
        assert recorder.calls == []
        shared_overlap._block_starts(block, (x,))  # (inside a block call, on another tensor)
        block.common(x.clone())
        shared_overlap._block_ends(block, (x,), None)
    assert recorder.calls == [("event on", "main")]


def test_a_shared_mlp_that_raises_gives_the_stream_back(recorder, monkeypatch):
    block, _ = _fused(Block(shared=Knot(24)))

    def broken(x):
        raise RuntimeError("broken shared MLP")

    monkeypatch.setattr(block.common, "forward", broken)
    with pytest.raises(RuntimeError, match="broken shared MLP"), torch.no_grad():
        block(torch.randn(2, 5, H))
    assert recorder.now is recorder.main and plan_of(block, "shared_overlap").switched is None
    assert recorder.calls[-2:] == [("current", "main"), ("main", "waits for", "side")]
    assert plan_of(block, "shared_overlap").started is None


def test_an_output_made_on_another_device_is_not_marked_for_the_block_s_stream(recorder, monkeypatch):
    block, _ = _fused(Block(shared=Knot(24)))
    monkeypatch.setattr(block.common, "forward", lambda x: torch.zeros(2, 5, H, device="meta"))  # (elsewhere)
    with torch.no_grad(), pytest.raises(Exception):
        block(torch.randn(2, 5, H))  # (the block's add fails across devices; the hooks must not)
    assert ("output used on", "main") not in recorder.calls and recorder.calls[-1] == ("main", "waits for", "side")
    assert recorder.now is recorder.main


def test_attaching_twice_adds_no_hooks():
    block, _ = _fused(Block(shared=Knot(24)))
    hooks = (len(block._forward_pre_hooks), len(block._forward_hooks), len(block.common._forward_pre_hooks))
    from mla_fuser.fusers.moe import MoEFuser

    match = MoEFuser.match(block)  # (the fuser's own match of the block, again)
    assert shared_overlap.attach_shared_overlap(block, match).endswith("(already)")
    assert hooks == (len(block._forward_pre_hooks), len(block._forward_hooks), len(block.common._forward_pre_hooks))


def test_a_fused_deepseek_model_overlaps_and_computes_what_native_does(recorder):
    import mla_fuser
    from conftest import tiny_deepseek

    native, fused = tiny_deepseek("deepseek_v2"), tiny_deepseek("deepseek_v2")
    report = mla_fuser.fuse(fused)
    rows = [r for r in report.rows if r.fuser == "moe"]
    assert rows and all("shared experts on a side stream" in r.reason for r in rows), str(report)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = native(input_ids=ids).logits, fused(input_ids=ids).logits
    assert ((want - got).abs().max() / want.abs().max()).item() <= 1e-4
    assert recorder.calls.count(("current", "side")) == len(rows)  # (one switch per MoE layer)
    assert recorder.now is recorder.main
