"""Chapter 01 end to end: mp.spawn and torchrun, figures and results.json."""

from __future__ import annotations

import pytest
from conftest import PROVENANCE_KEYS, assert_png, load_results, run_script

SCRIPT = "scripts/chapter01_processes.py"


def check_outputs(out, launcher: str) -> dict:
    for name in ("ranks.png", "replicas.png"):
        assert_png(out / "chapter01" / name)
    results = load_results(out, 1)
    assert results["provenance"].keys() >= PROVENANCE_KEYS
    assert results["provenance"]["launcher"] == launcher
    assert results["provenance"]["quick"] is True
    replicas = results["replicas"]
    assert replicas["same_seed"]["max_abs_diff"] == 0.0
    assert replicas["seed_plus_rank"]["max_abs_diff"] > 0.01
    assert replicas["seed_plus_rank_then_broadcast"]["max_abs_diff"] == 0.0
    assert results["all_reduce_sum_of_ranks"] == results["expected_sum_of_ranks"]
    for r in results["ranks"]:  # each group's all-reduce summed its own members only
        members = [other["rank"] for other in results["ranks"] if other["group"] == r["group"]]
        assert r["group_size"] == len(members)
        assert r["group_sum_of_ranks"] == sum(members)
    return results


@pytest.mark.slow
def test_quick_run_with_mp_spawn(out_dir):
    run = run_script(SCRIPT, "--quick", "--world-size", "2", "--out", str(out_dir))
    assert run.returncode == 0, run.stderr
    results = check_outputs(out_dir, "mp.spawn")
    assert [r["rank"] for r in results["ranks"]] == [0, 1]
    assert "replicas, same seed" in run.stdout


@pytest.mark.slow
def test_quick_run_with_torchrun(out_dir):
    run = run_script("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     SCRIPT, "--quick", "--out", str(out_dir))
    assert run.returncode == 0, run.stderr
    results = check_outputs(out_dir, "torchrun")
    assert len({r["pid"] for r in results["ranks"]}) == 2


def test_script_help_shows_the_shared_flags():
    run = run_script(SCRIPT, "--help")
    assert run.returncode == 0
    for flag in ("--world-size", "--backend", "--quick", "--out", "--seed", "--timeout"):
        assert flag in run.stdout
