"""Does freeing a CUDA object that an unreachable reference cycle holds, when the cyclic collector runs inside a CUDA
graph capture, invalidate the capture?  Each trial leaves one cycle holding one kind of object, captures two kernels
with a collection between them, and replays the graph.

Why: a DecodeGraph capture on Transformers 5.17 failed now and then with cudaErrorStreamCaptureInvalidated at its
first Triton launch after the layer began.  On an H100 (torch 2.11, benchmarks/results/capture_gc_probe_h100.log) a
captured CUDA graph freed that way fails the capture (PyTorch only warns of ``reset``'s error, and the next launch
reports it); events, pinned host tensors and streams do not.  (The trial after the failed one reports the invalid
state it left.)  Hence DecodeGraph turns the collector off while it captures.

    python benchmarks/probe_capture_gc.py      # needs CUDA; prints one line per trial
"""
import gc

import torch

x = torch.zeros(1 << 20, device="cuda")


def graph_of(fn):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = fn()
    return g, out


class Cycle:
    def __init__(self, payload):
        self.me, self.payload = self, payload


def trial(name, make_payload):
    gc.collect()
    gc.disable()
    Cycle(make_payload())  # garbage now, freed only by the collector
    g2 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g2):
            z = x + 1
            gc.collect()  # the collector runs inside the capture
            z * 3  # (a second kernel after the collection)
        g2.replay()
        torch.cuda.synchronize()
        print(f"{name}: capture ok", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{name}: capture FAILED: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
    finally:
        gc.enable()


def pinned():
    t = torch.empty(1024, pin_memory=True)
    t.copy_(x[:1024], non_blocking=True)  # (an event recorded on its use)
    return t


trial("nothing", lambda: None)
trial("event", lambda: torch.cuda.Event())
trial("recorded event", lambda: (lambda e: (e.record(), e)[1])(torch.cuda.Event()))
trial("captured graph", lambda: graph_of(lambda: x * 2))
trial("pinned host tensor used by a copy", pinned)
trial("device tensor", lambda: torch.empty(1 << 20, device="cuda"))
trial("stream", lambda: torch.cuda.Stream())
