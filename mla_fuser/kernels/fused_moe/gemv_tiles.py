"""Tuned tiles of the fused MoE decode GEMVs: data in ``kernels/tuned/moe_decode_gemv.json``, not code.

At one to a few tokens the small path's two launches are GEMVs (``moe_up_gemv_kernel``: gate/up + activation;
``moe_down_gemv_kernel``: down + routing weights + combine), bound by the expert weights they read.  Their best tiles
depend on the token count, the dtype (bf16 or block-FP8 weights) and the layer's size: on an H200 the FP8 down GEMV's
best tile at two tokens on a DeepSeek-V2-Lite layer (hidden 2048; 16 us) ran 2.3x slower than the best one on a
V3-shaped layer (hidden 7168; ``benchmarks/results/moe_decode_gemv_tables.json``).  So ``benchmarks/tune_moe_gemv.py --table`` writes one row per measured hidden
size, and a layer takes the row of the nearest hidden size (by ratio).  In a row, per dtype, token buckets (the
smallest bucket >= the tokens serves them; none past the last): ``gemv2`` always, ``gemv1`` only where the GEMV beat
the GEMM it replaces in that sweep (bf16; the FP8 GEMM1 has no such rival at decode sizes).

The tiles are valid on any GPU (they are tile sizes, never a different computation), just tuned on one.  A malformed
table raises, naming the file: a typo must not silently fall back to other tiles.
"""

from __future__ import annotations

import functools
import json
import math
import os

TABLE_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tuned", "moe_decode_gemv.json")
FIELDS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
DTYPES = ("bf16", "fp8")


def _tile(path: str, where: str, tile) -> dict:
    if not isinstance(tile, dict) or set(tile) != set(FIELDS):
        raise ValueError(f"{path}: {where} must have exactly the fields {list(FIELDS)}, got {tile!r}")
    for name in FIELDS:
        value = tile[name]
        ok = type(value) is int and value > 0 and (name not in ("BLOCK_N", "BLOCK_K") or value & (value - 1) == 0)
        if not ok:
            raise ValueError(f"{path}: {where} has {name}={value!r} (a positive int; a power of two for tiles)")
    return dict(tile)


@functools.lru_cache(maxsize=None)
def load_table(path: str = TABLE_PATH) -> dict:
    """``{hidden: {dtype: {bucket: {"gemv2": tile, "gemv1"?: tile}}}}``; ``{}`` when the file is absent."""
    if not os.path.isfile(path):
        return {}
    with open(path) as fh:
        data = json.load(fh)
    table = {}
    for hidden, rows in data.get("hidden", {}).items():
        if not str(hidden).isdigit() or int(hidden) <= 0 or not isinstance(rows, dict) or set(rows) - set(DTYPES):
            raise ValueError(f"{path}: hidden size {hidden!r} must be a positive int with rows {list(DTYPES)}")
        for dtype, buckets in rows.items():
            for bucket, entry in buckets.items():
                where = f"hidden {hidden} {dtype} bucket {bucket}"
                if not str(bucket).isdigit() or int(bucket) <= 0 or not isinstance(entry, dict) \
                        or "gemv2" not in entry or set(entry) - {"gemv1", "gemv2"}:
                    raise ValueError(f"{path}: {where} must be a positive token count with gemv2 (and gemv1)")
                table.setdefault(int(hidden), {}).setdefault(dtype, {})[int(bucket)] = {
                    key: _tile(path, f"{where} {key}", tile) for key, tile in entry.items()}
    return table


def decode_gemv_tiles(num_tokens: int, hidden: int = 0, fp8: bool = False, path: str = TABLE_PATH):
    """``(gemv1 or None, gemv2)`` for ``num_tokens`` tokens of a layer of ``hidden`` (0: unknown, the smallest
    measured size's row), copies; None where the table has no bucket that large (or no row)."""
    table = load_table(path)
    if not table:
        return None
    sizes = sorted(table)
    row = table[min(sizes, key=lambda h: abs(math.log(h / hidden)))] if hidden > 0 else table[sizes[0]]
    buckets = row.get("fp8" if fp8 else "bf16", {})
    for bucket in sorted(buckets):
        if num_tokens <= bucket:
            entry = buckets[bucket]
            gemv1 = entry.get("gemv1")
            return (dict(gemv1) if gemv1 else None), dict(entry["gemv2"])
    return None
