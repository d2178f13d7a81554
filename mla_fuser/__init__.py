"""mla-fuser: run multi-head latent attention (and Mamba / MoE blocks) fast in Hugging Face Transformers.

Importing registers the ``vllm_mla`` attention implementation (and its mask function) in Transformers'
registries.  Public API::

    model = mla_fuser.AutoModelForCausalLM.from_pretrained(path, attn_implementation="vllm_mla")
    report = mla_fuser.fuse(model)          # any model, in place, idempotent
    model.fusion_report                     # the same report
    step = mla_fuser.DecodeGraph(model, cache)  # decode steps replayed from one CUDA graph
    mla_fuser.release_decode_graphs(model)  # the static cache and step generate() kept for its next call
"""

from . import attention_interfaces  # noqa: F401  (registration side effect)
from .fusion import fuse
from .fusers.base import FusionReport, FusionRow
from .loader import AutoModel, AutoModelForCausalLM
from .runtime import DecodeGraph, release_decode_graphs

__version__ = "0.1.0"

__all__ = ["AutoModel", "AutoModelForCausalLM", "DecodeGraph", "FusionReport", "FusionRow", "fuse",
           "release_decode_graphs", "__version__"]
