"""Fusers, one per block kind.  ``match(module)`` works on any ``nn.Module`` by structure."""

from .base import Fuser, FusionReport, FusionRow
from .fp8 import FP8LinearFuser
from .gated_mlp import GatedMLPFuser, GatedMLPMatch
from .mamba import MambaFuser, MambaMatch
from .mla import MLAFuser, MLAMatch
from .moe import MoEFuser, MoEMatch
from .norm import NormFuser, NormMatch

__all__ = ["FP8LinearFuser", "Fuser", "FusionReport", "FusionRow", "GatedMLPFuser", "GatedMLPMatch", "MLAFuser",
           "MLAMatch", "MambaFuser", "MambaMatch", "MoEFuser", "MoEMatch", "NormFuser", "NormMatch"]
