"""The runtime layer: every per-instance entry point mla-fuser adds to a fused model (today ``generate``), and the
CUDA-graph replay of decode steps it uses.  Above the cache, the attention interfaces and the fusers; below
``fusion`` (which calls :func:`extend_generate` once a model is fused)."""

from .continuous_batching import extend_continuous_batching
from .decode_graph import DecodeGraph
from .generate import GraphedForward, eager_decode, extend_generate
from .kept_steps import release_decode_graphs

__all__ = ["DecodeGraph", "GraphedForward", "eager_decode", "extend_continuous_batching", "extend_generate",
           "release_decode_graphs"]
