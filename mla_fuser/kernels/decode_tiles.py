"""Tuned tiles of the paged MLA decode kernel per latent shape: data in ``tuned/mla_decode.json``, not code.

``mla_decode.default_config`` picks tiles from the head count alone, sized for DeepSeek-V2-Lite's 16 heads and
512 + 64 latent.  Other architectures (20 or 40 heads, a 256-wide latent, NoPE) run faster with other tiles, so
``benchmarks/tune_mla_decode.py`` sweeps them on a GPU and writes, per ``(heads, latent, rope)``, the config with the
smallest worst-case regret over a batch-bound and a split-bound case.  The table applies only where it was measured:
2-byte dtypes (bf16/fp16) on a CUDA device whose compute-capability major matches the tuning GPU's; anything else
(another shape, fp32, another GPU generation, the interpreter on CPU) keeps ``default_config``.  A table tuned on
another GPU (the script's ``--table`` output) replaces the shipped one through ``MLA_FUSER_DECODE_TILES``.
"""

from __future__ import annotations

import functools
import json
import os

import torch

from .. import envs
from .dispatch import capability_major

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned", "mla_decode.json")
FIELDS = ("block_h", "block_n", "num_warps", "num_stages", "swap_ab", "ctas_per_sm")


def _entry(path: str, key: str, fields: dict) -> tuple[tuple[int, int, int], dict]:
    heads, latent, rope = (int(x) for x in key.split(","))
    if set(fields) != set(FIELDS):
        raise ValueError(f"{path}: shape {key} has fields {sorted(fields)}, expected {sorted(FIELDS)}")
    for name in FIELDS:
        value = fields[name]
        ok = isinstance(value, bool) if name == "swap_ab" else (type(value) is int and value > 0)
        if not ok:
            raise ValueError(f"{path}: shape {key} has {name}={value!r}")
    return (heads, latent, rope), dict(fields)


@functools.lru_cache(maxsize=None)
def load_table(path: str = TABLE_PATH) -> tuple[int | None, dict]:
    """``(capability major the table was tuned on, {(heads, latent, rope): config fields})``; ``(None, {})`` when
    the file is absent.  A malformed table raises: a typo must not silently fall back to other tiles."""
    if not os.path.isfile(path):
        return None, {}
    with open(path) as fh:
        data = json.load(fh)
    shapes = dict(_entry(path, key, fields) for key, fields in data["shapes"].items())
    return int(data["capability"][0]), shapes


def table_path() -> str:
    """The table in use: ``$MLA_FUSER_DECODE_TILES`` where set (read at each call), else the shipped one."""
    return envs.decode_tiles_path() or TABLE_PATH


def tuned_tiles(num_heads: int, latent: int, rope: int, dtype: torch.dtype, device_index: int | None,
                path: str | None = None) -> dict | None:
    """The config fields of table ``path`` (default :func:`table_path`; the file parsed once) for this shape on CUDA
    device ``device_index`` (None off CUDA), or None."""
    if device_index is None or dtype not in (torch.bfloat16, torch.float16):
        return None
    major, shapes = load_table(path or table_path())
    if major is None or capability_major(device_index) != major:
        return None
    return shapes.get((num_heads, latent, rope))
