"""The fused MoE decode GEMVs' tile table (``kernels/fused_moe/gemv_tiles.py``, data in
``kernels/tuned/moe_decode_gemv.json``): parsing, the lookup by layer size and token count, malformed tables, the
shipped table's shape, and the default configs that carry it."""

import json

import pytest

from mla_fuser.kernels.fused_moe import configs, fp8_launch, gemv_tiles
from mla_fuser.kernels.fused_moe.launch import GEMV_DOWN_MAX_TOKENS

TILE = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=2)


def _write(tmp_path, data, name="table.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    gemv_tiles.load_table.cache_clear()
    return str(path)


def _table():
    small = dict(TILE, BLOCK_N=4)
    big = dict(TILE, BLOCK_K=1024)
    return json.loads(json.dumps({"hidden": {  # (a deep copy: the damage tests edit it)
        "2048": {"bf16": {"1": {"gemv1": small, "gemv2": small}, "4": {"gemv2": TILE}},
                 "fp8": {"2": {"gemv1": TILE, "gemv2": small}}},
        "7168": {"bf16": {"1": {"gemv2": big}}},
    }}))


def test_lookup_by_layer_size_and_tokens(tmp_path):
    path = _write(tmp_path, _table())
    small, big = dict(TILE, BLOCK_N=4), dict(TILE, BLOCK_K=1024)
    assert gemv_tiles.decode_gemv_tiles(1, 2048, path=path) == (small, small)
    assert gemv_tiles.decode_gemv_tiles(3, 2048, path=path) == (None, TILE)  # bucket 4: no gemv1 there
    assert gemv_tiles.decode_gemv_tiles(5, 2048, path=path) is None  # past the last bucket
    assert gemv_tiles.decode_gemv_tiles(1, 0, path=path) == (small, small)  # unknown size: the smallest row
    assert gemv_tiles.decode_gemv_tiles(1, 5120, path=path) == (None, big)  # nearer 7168 than 2048 by ratio
    assert gemv_tiles.decode_gemv_tiles(1, 3000, path=path) == (small, small)
    assert gemv_tiles.decode_gemv_tiles(2, 2048, fp8=True, path=path) == (TILE, small)
    assert gemv_tiles.decode_gemv_tiles(1, 7168, fp8=True, path=path) is None  # no FP8 row at that size
    got = gemv_tiles.decode_gemv_tiles(1, 2048, path=path)
    got[1]["BLOCK_N"] = 64  # copies: the table is not changed through them
    assert gemv_tiles.decode_gemv_tiles(1, 2048, path=path)[1]["BLOCK_N"] == 4
    assert gemv_tiles.decode_gemv_tiles(1, 2048, path=str(tmp_path / "absent.json")) is None


@pytest.mark.parametrize("damage, match", [
    (lambda t: t["hidden"].update({"wide": {}}), "hidden size 'wide'"),
    (lambda t: t["hidden"]["2048"].update({"fp16": {}}), "hidden size"),
    (lambda t: t["hidden"]["2048"]["bf16"]["4"].pop("gemv2"), "bucket 4 must"),
    (lambda t: t["hidden"]["2048"]["bf16"].update({"0": {"gemv2": TILE}}), "bucket 0 must"),
    (lambda t: t["hidden"]["2048"]["bf16"]["4"]["gemv2"].update(BLOCK_N=6), "BLOCK_N=6"),
    (lambda t: t["hidden"]["2048"]["bf16"]["4"]["gemv2"].update(num_warps=0), "num_warps=0"),
    (lambda t: t["hidden"]["2048"]["bf16"]["4"]["gemv2"].pop("num_stages"), "exactly the fields"),
    (lambda t: t["hidden"]["2048"]["bf16"]["4"].update(gemv3=TILE), "bucket 4 must"),
    (lambda t: t["hidden"]["2048"]["bf16"]["4"]["gemv2"].update(mma=True), "exactly the fields"),  # (removed)
])
def test_a_malformed_table_raises_naming_the_file(tmp_path, damage, match):
    table = _table()
    damage(table)
    path = _write(tmp_path, table, "broken.json")
    with pytest.raises(ValueError, match=match) as err:
        gemv_tiles.decode_gemv_tiles(1, 2048, path=path)
    assert "broken.json" in str(err.value)


def test_the_shipped_table():
    """A row per tuned size with both dtypes; buckets from one token up to at most ``GEMV_DOWN_MAX_TOKENS`` (past it
    the GEMVs never run); FP8 row tiles the launcher can fit to 128-row scale blocks."""
    gemv_tiles.load_table.cache_clear()
    table = gemv_tiles.load_table()
    assert set(table) == {2048, 7168}
    for hidden, rows in table.items():
        assert set(rows) == {"bf16", "fp8"}
        for dtype, buckets in rows.items():
            assert min(buckets) == 1 and max(buckets) <= GEMV_DOWN_MAX_TOKENS
            for entry in buckets.values():
                if dtype == "fp8":
                    assert "gemv1" in entry
                    assert all(fp8_launch.gemv_block_n(t["BLOCK_N"], (128, 128), 0) == t["BLOCK_N"]
                               for t in entry.values())


def test_default_configs_carry_the_table():
    """The bf16 small-path defaults take ``gemv1`` (where the table has it) and ``gemv2`` from the table; the FP8
    defaults add theirs as ``fp8_gemv1`` / ``fp8_gemv2`` beside the bf16 ones; past the buckets the old GEMV tile."""
    gemv_tiles.load_table.cache_clear()
    for hidden in (2048, 7168):
        for tokens in range(1, GEMV_DOWN_MAX_TOKENS + 1):
            gemv1, gemv2 = gemv_tiles.decode_gemv_tiles(tokens, hidden)
            cfg = configs.default_config("small", tokens, 6, 64, hidden)
            assert cfg["gemv2"] == gemv2 and cfg.get("gemv1") == gemv1
            fp8 = configs.default_fp8_config("small", tokens, 6, 64, hidden)
            assert (fp8["fp8_gemv1"], fp8["fp8_gemv2"]) == gemv_tiles.decode_gemv_tiles(tokens, hidden, fp8=True)
            assert fp8["gemv2"] == gemv2
    assert "gemv1" not in configs.default_config("small", 16, 6, 64, 2048)
    assert "fp8_gemv2" not in configs.default_fp8_config("aligned", 4, 6, 64, 2048)


def test_the_tuning_script_writes_what_the_table_reader_reads(tmp_path):
    """``benchmarks/tune_moe_gemv.py``: per shape and bucket the tile with the least worst-case regret, the bf16 up
    GEMV kept only where it beat the GEMM, written in the format :mod:`gemv_tiles` reads back."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "tune_moe_gemv.py")
    spec = importlib.util.spec_from_file_location("tune_moe_gemv", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)

    def rec(shape, kernel, dtype, tokens, bn, ms, err=0.0):
        return dict(shape=shape, kernel=kernel, dtype=dtype, tokens=tokens, BLOCK_N=bn, BLOCK_K=512, num_warps=4,
                    num_stages=2, rel_err=err, ms=ms)

    records = []
    for shape, scale in (("v2lite", 1.0), ("v3", 5.0)):
        for tokens in tune.TOKENS:
            records.append(dict(shape=shape, kernel="gemm1", dtype="bf16", tokens=tokens, rel_err=0.0,
                                ms=scale * (2.0 if tokens == 1 else 1.0)))
            for dtype in ("bf16", "fp8"):
                for kernel in ("up", "down"):
                    # tile 4 is fastest at one token, tile 8 elsewhere; tile 16 fastest of all but wrong
                    records.append(rec(shape, kernel, dtype, tokens, 4, scale * (1.0 if tokens == 1 else 1.6)))
                    records.append(rec(shape, kernel, dtype, tokens, 8, scale * (1.2 if tokens == 1 else 1.5)))
                    records.append(rec(shape, kernel, dtype, tokens, 16, scale * 0.5, err=0.5))
                    if dtype == "fp8" and tokens == 4:  # an earlier run's tensor-core variant (removed): never chosen
                        records.append(dict(rec(shape, kernel, dtype, tokens, 32, scale * 0.1), mma=True))
    _, tables = tune.choose(records)
    assert tables["v2lite"]["fp8"]["1"]["gemv2"]["BLOCK_N"] == 4
    assert tables["v2lite"]["fp8"]["2"]["gemv2"]["BLOCK_N"] == 8  # (never the wrong tile 16)
    assert tables["v2lite"]["fp8"]["4"]["gemv2"]["BLOCK_N"] == 8 and "mma" not in tables["v2lite"]["fp8"]["4"]["gemv2"]
    assert tables["v3"]["bf16"]["1"]["gemv1"]["beats_gemm1"]  # 1.0 against the GEMM's 2.0
    assert not tables["v3"]["bf16"]["2"]["gemv1"]["beats_gemm1"]  # 1.5 against 1.0
    out = _write(tmp_path, tune.package_table(tables, "test"))
    want_up = dict(TILE, BLOCK_N=4)
    assert gemv_tiles.decode_gemv_tiles(1, 2048, path=out) == (want_up, want_up)
    assert gemv_tiles.decode_gemv_tiles(2, 7168, path=out) == (None, dict(TILE, BLOCK_N=8))  # the GEMM won there
    assert gemv_tiles.decode_gemv_tiles(4, 7168, fp8=True, path=out) == (dict(TILE, BLOCK_N=8), dict(TILE, BLOCK_N=8))
    assert gemv_tiles.decode_gemv_tiles(2, 7168, fp8=True, path=out) == (dict(TILE, BLOCK_N=8), dict(TILE, BLOCK_N=8))
