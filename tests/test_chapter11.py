"""Chapter 11 end to end (--quick): the ledger to the byte, ours bitwise with native, bytes per
step, the ring's halves, accumulation, the 2 -> 3 rank reload, figures, --replot, torchrun."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import (
    PROVENANCE_KEYS,
    assert_png,
    load_results,
    refuse_in_process,
    run_quick,
    run_script,
)

SCRIPT = "scripts/chapter11_sharding.py"
FIGURES = ("ledger_formula.png", "ledger.png", "gathers.png", "timeline.png", "halves.png")
STAGES = ("ddp", "zero1_ours", "zero1_native", "zero2", "fsdp_ours", "fully_shard")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """The run's TMPDIR: the 2 -> 3 rank checkpoint goes there and must not stay."""
    return tmp_path_factory.mktemp("tmpdir")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory, scratch):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(scratch))
        return run_quick(tmp_path_factory, SCRIPT, 11)


@pytest.mark.slow
def test_quick_run_writes_every_figure_and_its_provenance(spawned):
    run, out, results = spawned  # its wall time is a benchmark (make bench), not a test
    for name in FIGURES:
        assert_png(out / "chapter11" / name)
    assert results["provenance"].keys() >= PROVENANCE_KEYS
    assert results["provenance"]["quick"] is True
    assert "Largest difference" in run.stdout
    assert "USDT" not in run.stderr  # the profiler's start/stop lines are kept off the screen
    assert "leaked" not in run.stderr


@pytest.mark.slow
def test_the_run_leaves_nothing_in_tmpdir(spawned, scratch):
    assert spawned[2]["reshard"]["world_size"] == 3  # the checkpoint was written there
    # torch's compiler cache (torchinductor_<user>) is meant to outlive runs: not ours.
    left = [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == []


@pytest.mark.slow
def test_ours_and_native_are_bitwise_equal(spawned):
    # 2 ranks: every element is (a + b)/2 whatever the order, so every pair is bitwise.
    diffs = spawned[2]["equality"]["max_abs_diff"]
    assert set(diffs) == {"zero1_ours_vs_zero_redundancy", "zero1_ours_vs_ddp",
                          "zero2_ours_vs_ddp", "fsdp_ours_vs_fully_shard", "fully_shard_vs_ddp",
                          "flat_layout_vs_fully_shard"}
    for name, value in diffs.items():
        assert value == 0.0, name


@pytest.mark.slow
def test_at_three_ranks_only_the_other_layouts_differ(spawned):
    # The 3-rank launch compares again: ours and native agree bit for bit; the flat layout and
    # DDP (another layout, and a multiply by 1/N before the sum) add in other orders.
    at_three = spawned[2]["equality_3"]
    assert at_three["world_size"] == 3
    differ = {"flat_layout_vs_fully_shard", "fully_shard_vs_ddp"}
    assert set(at_three["max_abs_diff"]) == set(spawned[2]["equality"]["max_abs_diff"])
    for name, value in at_three["max_abs_diff"].items():
        assert (value > 0.0) if name in differ else (value == 0.0), name
    first = at_three["first_difference"]
    assert first["fully_shard"] != first["flat_layout"]
    assert first["shard_major_offset"] != first["parameter_major_offset"]
    assert 0 <= first["owner"] < 3
    assert max(first["shard_major_offset"], first["parameter_major_offset"]) \
        < first["message_numel"]
    assert where_in_both_layouts(first["element"], 3) == {
        "owner": first["owner"], "shard_major": first["shard_major_offset"],
        "parameter_major": first["parameter_major_offset"]}
    assert spawned[2]["equality"]["first_difference"] is None  # 2 ranks: any order, same sum
    assert "The same at 3 ranks" in spawned[0].stdout


def where_in_both_layouts(element: str, world: int) -> dict:
    """``fsdp_layout.offsets`` for a name like ``3.weight[8, 2]`` of the --quick model."""
    import chapter11_sharding as chapter
    import torch

    from ddplab.fsdp_layout import offsets

    layer_name, rest = element.split(".", 1)
    name, position = rest.rstrip("]").split("[")
    layer = chapter.make_model(chapter.SIZES["quick"]).get_submodule(layer_name)
    names = [n for n, _ in layer.named_parameters()]
    shapes = [p.shape for p in layer.parameters()]
    shape = shapes[names.index(name)]
    at = torch.arange(shape.numel()).view(shape)[tuple(int(i) for i in position.split(","))]
    return offsets(shapes, names.index(name), at.item(), world)


@pytest.mark.slow
def test_ledger_equals_the_formula_to_the_byte(spawned):
    ledger = spawned[2]["ledger"]
    assert len(ledger["per_rank"]) == spawned[2]["provenance"]["world_size"]
    for rank in ledger["per_rank"]:
        assert set(rank) == set(STAGES)
        for stage in STAGES:  # our FSDP included: its shards are copies, not views
            assert rank[stage]["held"] == rank[stage]["predicted"], stage
        for stage in STAGES:
            assert rank[stage]["profiler_peak"] > 0, stage
        # ZeRO-1 ours and ZeroRedundancyOptimizer own the same parameters: the same bytes.
        assert rank["zero1_ours"]["held"] == rank["zero1_native"]["held"]
    numel = ledger["numel"]
    assert ledger["per_rank"][0]["ddp"]["held"]["params"] == 4 * numel
    ddp_paper = ledger["paper"]["mixed_adam"][0]  # the formula: 2 + 2 + 12 bytes per parameter
    assert ddp_paper["params"] + ddp_paper["grads"] + ddp_paper["optimizer_state"] \
        == 16 * 7_500_000_000


@pytest.mark.slow
def test_fsdp_sends_one_and_a_half_times_ddps_bytes(spawned):
    comm = spawned[2]["communication"]
    measured = comm["measured"]
    assert measured["fsdp_ours"] == measured["fully_shard"]  # same calls, same messages
    # DDP 2(N-1)/N·S per rank, FSDP 3(N-1)/N·S: the model's rows divide evenly at 2 ranks.
    assert measured["ddp"]["sent"] == comm["counted"]["ddp"]
    assert measured["fully_shard"]["sent"] == comm["counted"]["fsdp"]
    # gloo's reduce-scatter all-reduces the whole message: DDP's bytes again, not half of them.
    assert measured["fully_shard"]["sent_gloo"] == 2 * comm["counted"]["ddp"]
    assert measured["ddp"]["sent_gloo"] == comm["counted"]["ddp"]
    layers = comm["timeline"]["layers"]
    kinds = [e["kind"] for e in comm["timeline"]["events"]]
    assert kinds.count("all-gather") == 2 * len(layers)  # before forward, again in backward
    assert kinds.count("reduce-scatter") == len(layers)
    for row in comm["ring_halves"]["sizes"]:
        assert row["all_gather_max_abs_diff"] == 0.0  # copies only
        assert set(row["median_ms"]) >= {"ring_reduce_scatter", "gloo_reduce_scatter",
                                          "gloo_all_reduce"}


@pytest.mark.slow
def test_accumulation_clipping_and_the_reload_at_three_ranks(spawned):
    results = spawned[2]
    acc = results["accumulation"]
    for mode in ("every_micro_batch", "once_per_step"):
        assert acc[mode]["ours_vs_fully_shard"] == 0.0, mode
    k = acc["micro_batches"]
    every = acc["every_micro_batch"]["bytes_per_step"]
    once = acc["once_per_step"]["bytes_per_step"]
    assert every["all_gather"] == once["all_gather"]  # the gathers happen either way
    assert every["reduce_scatter"] == k * once["reduce_scatter"]
    # Before the last micro-batch: full gradients (DDP's bytes) against this rank's padded shards.
    rank0 = results["ledger"]["per_rank"][0]
    assert acc["once_per_step"]["gradients_held"] == rank0["ddp"]["held"]["grads"]
    assert acc["every_micro_batch"]["gradients_held"] == rank0["fully_shard"]["predicted"]["grads"]
    clip = acc["clipping"]
    assert clip["global_rel_err"] < 1e-5
    assert clip["grads_max_abs_diff"] == 0.0  # 2 ranks: the norms see the same gradients
    assert all(n < clip["full_model_norm"] for n in clip["local_norm_per_rank"])
    reshard = results["reshard"]
    assert (reshard["saved_at"], reshard["world_size"]) == (2, 3)
    assert reshard["loaded_max_abs_diff"] == 0.0
    assert reshard["continued_max_abs_diff"] == 0.0
    assert reshard["without_checkpoint_max_abs_diff"] > 0.0  # the control: the load mattered
    verdicts = results["verdicts"]
    assert verdicts["reshard_text"] == "bitwise equal"
    assert verdicts["fsdp_sends_text"] == "1.5 times"
    assert verdicts["fsdp_sends_gloo_text"] == "2 times"
    assert verdicts["sent_by_this_run"] == "gloo's"


@pytest.mark.slow
def test_replot_redraws_from_results_alone(spawned, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(spawned[1], out)
    for name in FIGURES:
        (out / "chapter11" / name).unlink()
    run = run_script(SCRIPT, "--replot", "--out", str(out))
    assert run.returncode == 0, run.stderr
    for name in FIGURES:
        assert_png(out / "chapter11" / name)


def test_replot_names_a_missing_key(tmp_path):
    folder = tmp_path / "chapter11"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"chapter": 11, "ledger": {}}))
    run = run_script(SCRIPT, "--replot", "--out", str(tmp_path))
    assert run.returncode != 0
    assert "ledger.paper" in run.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_verdicts_follow_the_numbers(spawned):
    from backstage import chapter11_report

    results = json.loads(json.dumps(spawned[2]))
    results["equality"]["max_abs_diff"]["flat_layout_vs_fully_shard"] = 3e-8
    results["reshard"]["continued_max_abs_diff"] = 1e-7
    verdicts = chapter11_report.verdicts(results, "gloo")
    assert verdicts["equal"]["flat_layout_vs_fully_shard"] == "apart by up to 3e-08"
    assert verdicts["reshard_text"] == "apart by up to 1e-07"
    held = results["ledger"]["per_rank"][0]["zero2"]["held"]
    held["params"] += 4
    exact = chapter11_report.verdicts(results, "gloo")["ledger_exact_text"]
    assert exact["zero2"] == "not to the byte"


@pytest.mark.slow
def test_torchrun_runs_the_same_code_and_skips_the_reload(tmp_path):
    run = run_script("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     SCRIPT, "--quick", "--out", str(tmp_path), timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    results = load_results(tmp_path, 11)
    assert results["provenance"]["launcher"] == "torchrun"
    assert "torchrun" in results["reshard"]["skipped"]
    assert "equality_3" not in results  # no 3-rank launch under torchrun
    assert results["equality"]["max_abs_diff"]["fsdp_ours_vs_fully_shard"] == 0.0
    for name in FIGURES:
        assert_png(tmp_path / "chapter11" / name)


@pytest.mark.parametrize(("argv", "message"), [
    (["--micro-batches", "5"], "--micro-batches must divide"),
    (["--micro-batches", "0"], "--micro-batches: must be positive, got 0"),
    (["--steps", "-1"], "--steps: must be positive, got -1"),
])
def test_bad_flags_are_one_clear_line(argv, message, tmp_path):
    code, err = refuse_in_process(SCRIPT, *argv, "--out", str(tmp_path))
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
