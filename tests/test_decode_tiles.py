"""The decode kernel's tuned tile table (``kernels.decode_tiles``): parsing, where it applies, and that every tile
config it ships computes the right attention for its own shape (Triton's interpreter, against the fp32 reference)."""

from __future__ import annotations

import json

import pytest
import torch

from mla_fuser.kernels import decode_tiles
from mla_fuser.kernels import mla_decode as md

from test_kernel_mla_decode import _check, _ref32, make_case

FIELDS = {"block_h": 32, "block_n": 64, "num_warps": 8, "num_stages": 3, "swap_ab": False, "ctas_per_sm": 2}


@pytest.fixture
def fresh_plans():
    md._launch_plan.cache_clear()
    yield
    md._launch_plan.cache_clear()


def _write(tmp_path, shapes, capability=(9, 0)):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"capability": list(capability), "shapes": shapes}))
    return str(path)


def test_table_parses_and_keys_by_heads_latent_rope(tmp_path):
    major, shapes = decode_tiles.load_table(_write(tmp_path, {"40,256,32": FIELDS, "32,512,0": FIELDS}))
    assert major == 9
    assert shapes == {(40, 256, 32): FIELDS, (32, 512, 0): FIELDS}
    assert decode_tiles.load_table(str(tmp_path / "absent.json")) == (None, {})


@pytest.mark.parametrize("bad", [
    {k: v for k, v in FIELDS.items() if k != "num_stages"},  # a field missing
    dict(FIELDS, block_n=0),  # not positive
    dict(FIELDS, num_warps=8.0),  # not an int
    dict(FIELDS, swap_ab=1),  # not a bool
    dict(FIELDS, extra=1),  # unknown field
])
def test_a_malformed_table_raises_naming_the_file_and_the_shape(tmp_path, bad):
    with pytest.raises(ValueError, match="table.json: shape 20,512,64"):
        decode_tiles.load_table(_write(tmp_path, {"20,512,64": bad}))


def test_tuned_tiles_apply_only_to_2_byte_dtypes_on_the_tuned_gpu_generation(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_tiles, "TABLE_PATH", _write(tmp_path, {"20,512,64": FIELDS}))
    monkeypatch.setattr(decode_tiles, "capability_major", lambda index: 9)
    assert decode_tiles.tuned_tiles(20, 512, 64, torch.bfloat16, 0) == FIELDS
    assert decode_tiles.tuned_tiles(20, 512, 64, torch.float16, 0) == FIELDS
    assert decode_tiles.tuned_tiles(20, 512, 64, torch.float32, 0) is None  # fp32: never tuned
    assert decode_tiles.tuned_tiles(20, 512, 64, torch.bfloat16, None) is None  # off CUDA
    assert decode_tiles.tuned_tiles(16, 512, 64, torch.bfloat16, 0) is None  # another shape
    monkeypatch.setattr(decode_tiles, "capability_major", lambda index: 8)
    assert decode_tiles.tuned_tiles(20, 512, 64, torch.bfloat16, 0) is None  # another GPU generation


def test_the_launch_plan_takes_tuned_tiles_unless_a_config_is_given_or_rows_are_not_heads(monkeypatch, fresh_plans):
    asked = []

    def tuned(heads, latent, rope, dtype, dev, path):
        asked.append((heads, latent, rope, dtype, dev, path))
        return FIELDS

    monkeypatch.setattr(decode_tiles, "tuned_tiles", tuned)
    plan = md._launch_plan(4, 20, 512, 64, 64, 8, torch.bfloat16, None, None, 0, "table.json")
    assert plan[0] == md.MLADecodeConfig(**FIELDS) and plan[1] == 32  # block_h from the table
    assert asked == [(20, 512, 64, torch.bfloat16, 0, "table.json")]
    given = md.MLADecodeConfig(block_h=16, block_n=32)
    assert md._launch_plan(4, 20, 512, 64, 64, 8, torch.bfloat16, given, None, 0, "table.json")[0] == given
    # no table (rows that are not heads: the split-row launcher's token x head rows): the head-count defaults
    assert md._launch_plan(4, 80, 512, 64, 64, 8, torch.bfloat16, None, None, 0)[0] == md.default_config(
        80, torch.bfloat16)
    assert len(asked) == 1


def test_a_table_of_ones_own_replaces_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_tiles, "capability_major", lambda index: 9)
    assert decode_tiles.table_path() == decode_tiles.TABLE_PATH
    own = _write(tmp_path, {"16,512,64": FIELDS})
    monkeypatch.setenv("MLA_FUSER_DECODE_TILES", own)
    assert decode_tiles.table_path() == own
    assert decode_tiles.tuned_tiles(16, 512, 64, torch.bfloat16, 0) == FIELDS
    monkeypatch.setenv("MLA_FUSER_DECODE_TILES", str(tmp_path / "absent.json"))
    from mla_fuser.envs import SettingError

    with pytest.raises(SettingError, match="MLA_FUSER_DECODE_TILES"):
        decode_tiles.table_path()


def test_the_shipped_table_is_valid():
    major, shapes = decode_tiles.load_table()
    if major is None:
        pytest.skip("no tuned table shipped")
    assert shapes, "a shipped table must hold shapes"
    assert all(h > 0 and r > 0 and rope >= 0 for h, r, rope in shapes)


def _shipped():
    major, shapes = decode_tiles.load_table()
    return sorted(shapes.items()) if major is not None else []


@pytest.mark.parametrize("shape,fields", _shipped() or [pytest.param(None, None, marks=pytest.mark.skip("no table"))])
def test_every_shipped_tile_config_computes_its_shape_right(interp, shape, fields):
    # Each tuned config on a small ragged batch of its own shape (heads, latent, rope; the rows scaled down 8x so the
    # interpreter stays quick, the head count and rope kept), with one and several splits, against fp32.
    heads, latent, rope = shape
    cfg = md.MLADecodeConfig(**fields)
    q, kv, bt, lens = make_case([0, 1, 70, 150], heads, latent // 8, rope, 64, torch.bfloat16, seed=heads + rope)
    ref = _ref32(q, kv, bt, lens, 0.2, latent // 8)
    for splits in (1, 3):
        _check(md.mla_decode_triton(q, kv, bt, lens, 0.2, latent // 8, num_splits=splits, config=cfg), ref,
               torch.bfloat16)
