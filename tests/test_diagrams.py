"""The drawn diagrams (scripts/drawing/diagrams.py): the committed PNGs are what it draws."""

from __future__ import annotations

import struct

from conftest import REPO, assert_png, run_script

COMMITTED = REPO / "figures" / "diagrams"


def png_size(path) -> tuple[int, int]:
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the IHDR chunk
    return width, height


def test_diagrams_regenerate_as_committed(tmp_path):
    run = run_script("scripts/drawing/diagrams.py", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert drawn == sorted(p.name for p in COMMITTED.glob("*.png")), (
        "figures/diagrams/ is stale: run `python scripts/drawing/diagrams.py` and commit the PNGs")
    for name in drawn:
        assert_png(tmp_path / name)
        assert png_size(tmp_path / name) == png_size(COMMITTED / name), name


def test_the_overlap_model_has_buckets_win():
    """The timeline diagram's claim, from its own model: several buckets end the step first."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "diagrams", REPO / "scripts" / "drawing" / "diagrams.py")
    diagrams = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diagrams)
    end = {name: diagrams._comm_schedule(sizes)[-1][1] for name, sizes in
           {"per gradient": [1] * diagrams.LAYERS, "one bucket": [diagrams.LAYERS],
            "several": [2] * (diagrams.LAYERS // 2)}.items()}
    assert end["several"] < min(end["per gradient"], end["one bucket"])
