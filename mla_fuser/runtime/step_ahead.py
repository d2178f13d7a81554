"""A graphed decode step launched ahead: the next step's replay queued as soon as the token it feeds is chosen.

Why: Transformers' decoding loop waits for the GPU once per step (its stop check reads ``unfinished_sequences`` on
the host), then prepares the next step's inputs and calls the forward that launches the replay.  Everything the
host does between that wait and the launch (Transformers' input preparation and bookkeeping, our step checks and
input copies: about 0.2 ms per step on an H200) is time the GPU sits idle, at every step.  Transformers 5.25 has
the same diagnosis (``DeferredStopCheck``) and defers its stop check on Apple GPUs only; its loop is not ours to
change.

What: for a graphed single-beam greedy or sampling call, :class:`LaunchNextStep` is appended to the call's stopping
criteria (the only hook the loop calls after it has appended the chosen tokens to ``input_ids`` and before it
waits).  It returns "not done" for every sequence and, when the next step will be a replayed one, launches that
replay at once on a side CUDA stream (ordered after everything queued so far: the chosen tokens exist on the
device, the previous step's logits were read).  The loop's wait is on its own stream, so it no longer waits for the
step; the host prepares the next forward while the GPU runs it.  The next forward of ``GraphedForward`` takes the
logits of the step launched ahead when it asks for exactly that step, and waits for the side stream first:

* the same tokens: its ``input_ids`` is the very view ``input_ids[:, -1:]`` the step copied (same memory, shape
  and strides: our ``prepare_inputs_for_generation`` hands the loop's ``input_ids`` on as that view, and the full
  tensor is held until then, so its memory cannot be reused by another);
* the same cache, with nothing done to it in between (a single beam: no reorder, no crop);
* the same positions: the step ahead places the token at the cache's next position
  (``PagedLatentCache.next_positions``), which is what the forward uses when it is given no positions.  Given
  positions (Transformers 5.x passes them) are compared once per call, at the first step taken: both advance by
  one token per step from there, so a call whose positions differ (the caller's own ``position_ids``) is found at
  its first step and runs on without steps ahead.

Anything else (another forward, a call that stops: at its end, after the last token, by an end token or a stopping
criterion of the caller) finds the step unclaimed: it is taken back (``DecodeGraph.take_back``: the cache one token
shorter on the device and the host; the row written past the end is never read) before anything else runs, so the
cache reads as it would have without the step.  The cost of a stop the loop decides on the device is one step of
GPU time, once per call.  Not used where the next input is not known at that point or the cache cannot take a step
back: beam search (the reorder comes later), assisted and prompt-lookup decoding, state (Mamba) layers, padding
other than on the left (its positions are the caller's), a model with its own ``prepare_inputs_for_generation``,
a cache split over devices;
``MLA_FUSER_STEP_AHEAD=0`` turns it off.
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteria

# read when a call starts (``MLA_FUSER_STEP_AHEAD=0`` turns it off for the process): benchmarks flip it for a
# same-process A/B
LAUNCH_AHEAD = True
# Without capture (a CPU, where tests force the graphed plan) a step ahead runs eagerly: no overlap to win and one
# step more at the end of each call, so it is off there; tests turn it on to exercise the same bookkeeping.
WITHOUT_CAPTURE = False


class StepAhead:
    """The step launched ahead for one graphed ``generate`` call, if any, and what became of the steps launched.

    ``graphed``: the call's ``GraphedForward`` (its ``graph``, ``cache`` and ``keyword``); ``stop_length``: the
    length at which the call ends for certain (its ``max_new_tokens``): no step is launched from there."""

    def __init__(self, graphed, stop_length: int):
        self.graphed = graphed
        self.stop_length = stop_length
        graph = graphed.graph
        self.stream = graph.side_stream() if graph.capture else None
        self.enabled = True
        self.positions_checked = False
        self.one_device = None  # whether every paged layer's cache is on the graph's device (read at the first launch)
        self.pending = None  # (the loop's input_ids, the view the step read, positions, logits) of the step ahead
        self.taken = self.taken_back = 0

    def criterion(self) -> "LaunchNextStep":
        return LaunchNextStep(self)

    def launch(self, input_ids: torch.Tensor) -> None:
        """Launch the step that feeds ``input_ids``' last tokens, when the next forward will replay it."""
        graphed = self.graphed
        if (not self.enabled or self.pending is not None or graphed.output_type is None
                or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2
                or input_ids.shape[1] >= self.stop_length or input_ids.device != graphed.graph.device):
            return
        graph, batch = graphed.graph, input_ids.shape[0]
        if not graph.replay_ready(batch):
            return
        if self.one_device is None:  # (once: a model split over devices keeps its steps where the forward runs them)
            self.one_device = all(layer.seq_lens.device == graph.device for layer in graphed.cache.paged)
        if not self.one_device:
            self.enabled = False
            return
        ids = input_ids[:, -1:]
        stream = self.stream
        graphed._inside = True  # (an eager step calls the model: its original forward)
        try:
            if stream is None:
                positions = graphed.cache.next_positions(batch)
                logits = graph.launch(ids, positions)
            else:
                stream.wait_stream(torch.cuda.current_stream(graph.device))
                with torch.cuda.stream(stream):
                    positions = graphed.cache.next_positions(batch)
                    logits = graph.launch(ids, positions)
                input_ids.record_stream(stream)  # (read there; held in ``pending`` until the forward that waits)
        finally:
            graphed._inside = False
        self.pending = (input_ids, ids, positions, logits)

    def take(self, kwargs: dict, decode_step: bool) -> torch.Tensor | None:
        """The logits of the step launched ahead when the forward called with ``kwargs`` asks for exactly it (a
        fresh tensor); None otherwise, the step taken back first when there is one (see the module docstring)."""
        pending = self.pending
        if pending is None:
            return None
        self.pending = None
        _, view, positions, logits = pending
        self._wait()
        ids = kwargs.get("input_ids")
        same = (decode_step and isinstance(ids, torch.Tensor) and ids.data_ptr() == view.data_ptr()
                and ids.shape == view.shape and ids.stride() == view.stride()
                and kwargs.get(self.graphed.keyword) is self.graphed.cache)
        if same and not self.positions_checked:
            given = kwargs.get("position_ids")
            if isinstance(given, torch.Tensor) and given.shape == positions.shape:
                same = torch.equal(given.to(positions.device), positions)  # (once per call: the host waits here)
            self.positions_checked = True
        if not same:  # (not expected of Transformers' loop: the call goes on without steps ahead)
            self.enabled = False
            self._take_back()
            return None
        self.taken += 1
        return logits.clone()

    def drop(self) -> None:
        """Take back a step nobody asked for (the call ended, or another forward comes)."""
        if self.pending is not None:
            self.pending = None
            self._wait()
            self._take_back()

    def close(self) -> None:
        """At the call's end: :meth:`drop`, then let go of the call's forward (it holds this object: without the
        cycle, the forward and its graph are freed as soon as the call is done with them, not by a later collection
        that might run inside another capture)."""
        self.drop()
        self.enabled = False
        self.graphed = None

    def _wait(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.graphed.graph.device).wait_stream(self.stream)

    def _take_back(self) -> None:
        self.graphed.graph.take_back()
        self.taken_back += 1


class LaunchNextStep(StoppingCriteria):
    """A stopping criterion that never stops anything: it launches the next decode step (:class:`StepAhead`)."""

    def __init__(self, ahead: StepAhead):
        self.ahead = ahead
        self._none_done = None

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.ahead.launch(input_ids)
        done = self._none_done
        if done is None or done.shape[0] != input_ids.shape[0] or done.device != input_ids.device:
            done = self._none_done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return done
