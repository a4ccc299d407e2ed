"""Chapter 10: the cost model (fast), the emulated nodes and their teardown (root), --quick."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import chapter10_many_nodes as ch10
import pytest
from conftest import (
    PROVENANCE_KEYS,
    REPO,
    assert_png,
    load_results,
    refuse_in_process,
    run_quick,
    run_script,
)
from test_faults_nodes import left_by, start_mini_launcher

from ddplab import costmodel
from ddplab.run import netns

SCRIPT = "scripts/chapter10_many_nodes.py"
NEEDS_ROOT = pytest.mark.skipif(netns.unavailable_reason() is not None,
                                reason=f"{netns.unavailable_reason()}")
MiB = 1 << 20


# --- the cost model ---------------------------------------------------------------------------

def test_ring_time_is_the_alpha_beta_formula():
    assert costmodel.ring_time(1e6, 1, 1e-3, 1e9) == 0.0  # alone: nothing to do
    # two ranks: 2 messages and each rank sends the whole tensor once (2(N-1)/N = 1)
    assert costmodel.ring_time(1e6, 2, 1e-5, 1e9) == pytest.approx(2e-5 + 1e-3)
    # bandwidth term tends to 2·S/B as N grows; the latency term grows linearly
    assert costmodel.ring_time(1e6, 1024, 0, 1e9) == pytest.approx(2 * 1023 / 1024 * 1e-3)
    assert costmodel.ring_time(0, 1024, 1e-6, 1e9) == pytest.approx(2 * 1023 * 1e-6)


def test_tree_latency_grows_with_log_n():
    assert costmodel.tree_time(0, 1024, 1e-6, 1e9) == pytest.approx(2 * 10 * 1e-6)
    assert costmodel.tree_time(0, 1024, 1e-6, 1e9) < costmodel.ring_time(0, 1024, 1e-6, 1e9)


def test_hierarchical_inside_one_node_is_a_ring_over_nvlink():
    nv, ib = costmodel.LINKS["nvlink4"], costmodel.LINKS["ib-ndr"]
    inside = costmodel.hierarchical_time(64 * MiB, 8, 8, nv, ib, 8)
    assert inside == pytest.approx(costmodel.ring_time(64 * MiB, 8, nv.alpha_us * 1e-6,
                                                      nv.gbytes_per_s * 1e9))


def test_hierarchical_across_nodes_adds_a_ring_over_one_eighth():
    nv, ib = costmodel.LINKS["nvlink4"], costmodel.LINKS["ib-ndr"]
    size = 64 * MiB
    two_nodes = costmodel.hierarchical_time(size, 16, 8, nv, ib, nics_per_node=8)
    inside = costmodel.hierarchical_time(size, 8, 8, nv, ib, 8)
    across = costmodel.ring_time(size / 8, 2, ib.alpha_us * 1e-6, ib.gbytes_per_s * 1e9)
    assert two_nodes == pytest.approx(inside + across)


def test_step_time_hides_all_but_the_last_bucket_when_links_are_fast():
    # three equal buckets, each all-reduce shorter than the backward time between buckets:
    # only the last one (ready when backward ends) is exposed
    r = costmodel.step_time(0.3, [1.0, 1.0, 1.0], lambda size: 0.01)
    assert r["exposed_s"] == pytest.approx(0.01)
    assert r["step_s"] == pytest.approx(0.31)


def test_step_time_exposes_the_queue_when_links_are_slow():
    # forward 0.1, backward 0.2 (buckets ready at 0.167, 0.233, 0.3); each all-reduce 1 s
    r = costmodel.step_time(0.3, [1.0, 1.0, 1.0], lambda size: 1.0)
    assert r["step_s"] == pytest.approx(0.1 + 0.2 / 3 + 3.0)
    assert r["efficiency"] == pytest.approx(0.3 / r["step_s"])


def test_step_time_with_free_communication_is_compute():
    r = costmodel.step_time(0.5, costmodel.bucket_sizes(100 * MiB, 25 * MiB), lambda s: 0.0)
    assert r["efficiency"] == 1.0 and r["exposed_s"] == 0.0


def test_bucket_sizes_add_up():
    assert costmodel.bucket_sizes(10, 4) == [4, 4, 2]
    assert costmodel.bucket_sizes(8, 4) == [4, 4]


def test_projection_scales_worse_on_slower_links_and_more_gpus():
    cal = ch10.calibration(Path("/nonexistent"))  # the committed runs of chapters 03 and 05
    curves = ch10.project(cal, book_grad_bytes=8 * MiB)
    for name in ("book", "1B", "7B"):
        ib, eth = curves[f"{name}_ib-ndr"], curves[f"{name}_eth-100g"]
        assert ib["gpus"][0] == 2 and ib["gpus"][-1] == 1024
        assert ib["efficiency"][-1] <= ib["efficiency"][2]  # 1024 GPUs vs 8 (one node)
        assert all(e <= i + 1e-12 for e, i in zip(eth["efficiency"], ib["efficiency"],
                                                   strict=True))


# --- calibration ----------------------------------------------------------------------------------

def test_calibration_reads_the_committed_run():
    cal = ch10.calibration(Path("/nonexistent"))
    committed = json.loads((REPO / "figures/chapter03/results.json").read_text())
    assert cal["alpha_us"] == committed["alpha_beta"]["native"]["alpha_us"]
    assert "committed run" in cal["source"]


def test_calibration_found_nowhere_is_a_clear_error_not_typed_numbers(tmp_path, monkeypatch):
    # chapter 03's results in another shape (its keys may change), and no committed figures
    for chapter, payload in ((3, {"fit": {"alpha": 1}}), (5, {"step_time_ms": {}})):
        (tmp_path / f"chapter{chapter:02d}").mkdir()
        (tmp_path / f"chapter{chapter:02d}" / "results.json").write_text(json.dumps(payload))
    monkeypatch.setattr(ch10.ddplab.run.results, "REPO_ROOT", tmp_path / "nowhere")
    with pytest.raises(ch10.ddplab.UsageError, match="run `make run-chapter03 run-chapter05`"):
        ch10.calibration(tmp_path)


def test_committed_link_bound_prediction_is_within_15_percent():
    # on the 100 Mbit/s link the step is bound by the cable, which the model knows exactly
    results = json.loads((REPO / "figures/chapter10/results.json").read_text())
    if not results["two_nodes"]:
        pytest.skip("the committed run had no two emulated nodes")
    row = results["validation"]["runs"]["2x2_100mbit"]
    measured = results["two_node"]["phases"]["100mbit"]
    predicted = ch10.predict_emulated(measured["compute_ms"], measured["grad_bytes"], 4, 100.0,
                                      results["calibration"])
    assert predicted == pytest.approx(row["predicted_ms"])
    assert abs(predicted - row["measured_ms"]) / row["measured_ms"] < 0.15


# --- emulated nodes and their teardown ----------------------------------------------------------

@NEEDS_ROOT
def test_two_namespaces_are_built_and_torn_down_with_what_runs_inside():
    pair = netns.TwoNodes.create(tag=f"ddpl-t{time.time_ns() % 10**5}")
    try:
        assert all(pair.exists().values())
        pair.set_rate(100.0)
        shaped = subprocess.run(["tc", "-n", pair.nodes[0].namespace, "qdisc", "show"],
                                capture_output=True, text=True, timeout=10).stdout
        assert "tbf" in shaped and "100Mbit" in shaped
        sleeper = subprocess.Popen(pair.nodes[1].command(["sleep", "600"]))
        time.sleep(0.5)
        assert pair.pids(pair.nodes[1])
    finally:
        pair.close()
    assert sleeper.wait(timeout=10) != 0  # killed, not finished
    assert not any(pair.exists().values())


def leftovers(tag: str) -> list[str]:
    """Namespaces, links or processes of the run tagged ``tag`` still on the machine."""
    found = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                       timeout=10).stdout.split() if n.startswith(tag)]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10)
    found += [ln for ln in links.stdout.splitlines() if tag[:10] in ln]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if tag.encode() in (proc / "cmdline").read_bytes():
                found.append(f"process {proc.name}")
        except OSError:
            pass
    return found


@NEEDS_ROOT
@pytest.mark.slow
def test_killed_node_ends_the_other_with_a_clear_error_and_leaves_nothing(tmp_path):
    run = run_script(SCRIPT, "--quick", "--timeout", "30", "--kill-node-after", "1",
                     "--out", str(tmp_path), timeout=240)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: node a stopped"), last
    assert "Connection closed by peer" in last or "Connection reset" in last, last
    assert not (tmp_path / "chapter10" / "results.json").exists()
    assert not leftovers("ddpl-"), leftovers("ddpl-")


# Ctrl-C, SIGTERM and SIGKILL at well-defined points of the run: tests/test_faults_nodes.py


# --- the whole chapter ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def killed_run() -> int | None:
    """The pid of a two-node launcher killed with SIGKILL just before the chapter's run: what
    it left (namespaces, cable, qdisc) is the next run's to remove.  None without root."""
    if netns.unavailable_reason() is not None:
        return None
    launcher = start_mini_launcher()
    launcher.kill()
    launcher.wait()
    return launcher.pid


@pytest.fixture(scope="module")
def chapter(tmp_path_factory, killed_run):
    """One --quick run for every check of the whole chapter.  Where two nodes can be emulated
    it also loses a node (--failover), which adds to the quick run, changing none of it; and it
    is the run that comes after a killed one (``killed_run``)."""
    if netns.unavailable_reason() is not None:
        return run_quick(tmp_path_factory, SCRIPT, 10)
    out = tmp_path_factory.mktemp("ch10")
    run = run_script(SCRIPT, "--quick", "--failover", "--timeout", "60", "--out", str(out),
                     timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, out, load_results(out, 10)


@pytest.mark.slow
def test_quick_run_writes_everything(chapter):
    run, out, results = chapter
    for name in ("links.png", "projection.png"):
        assert_png(out / "chapter10" / name)
    assert results["provenance"].keys() >= PROVENANCE_KEYS
    assert results["provenance"]["quick"] is True
    assert set(results["validation"]["runs"]) >= {"1x2_loopback"}
    assert math.isfinite(results["validation"]["max_rel_error"])
    if netns.unavailable_reason() is None:
        phases = results["two_node"]["phases"]
        assert set(phases) == set(ch10.RATES)
        assert results["two_node"]["world_size"] == 4
        # the cable is the bottleneck at 100 Mbit/s: more exposed communication than unshaped
        assert phases["100mbit"]["exposed_ms"] > phases["unshaped"]["exposed_ms"]
        assert not leftovers("ddpl-")
    else:
        assert "two emulated nodes skipped" in run.stdout


@NEEDS_ROOT
@pytest.mark.slow
def test_the_run_removed_what_a_killed_run_left_and_said_so(chapter, killed_run):
    run, _, _ = chapter
    try:
        notes = [ln for ln in run.stdout.splitlines() if ln.startswith("note: removed")]
        assert len(notes) == 1, run.stdout
        assert notes[0].startswith("note: removed what an earlier two-node run left when it "
                                   "was killed: namespace ddpl-"), notes[0]
        assert all(f"namespace ddpl-{killed_run}-{n}" in notes[0] for n in "ab"), notes[0]
        assert not left_by(killed_run)
    finally:
        netns.remove_leftovers()


def test_bad_link_is_one_line():
    code, err = refuse_in_process(SCRIPT, "--gpus", "64", "--link", "carrier-pigeon")
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "--link" in err


# --- the recipes (they cannot run here: syntax and shape only) ---------------------------------

@pytest.mark.parametrize("name", ["slurm_ddp.sbatch", "cluster.env"])
def test_shell_recipes_parse(name):
    check = subprocess.run(["bash", "-n", str(REPO / "recipes" / name)], capture_output=True,
                           text=True, timeout=10)
    assert check.returncode == 0, check.stderr


def test_slurm_recipe_runs_one_torchrun_per_node_meeting_on_the_first_node():
    text = (REPO / "recipes/slurm_ddp.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in text
    assert 'head -n 1' in text and '--rdzv-endpoint "$head_node:$rdzv_port"' in text
    assert "--rdzv-backend c10d" in text and "srun" in text


def test_pytorchjob_manifest_has_the_shape_the_operator_expects():
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load((REPO / "recipes/pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    for spec in specs.values():
        container = spec["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch"  # the operator finds the container by this name
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert str(gpus) == job["spec"]["nprocPerNode"]  # one rank per GPU
        assert "$PET_NODE_RANK" in container["args"][0]


@NEEDS_ROOT
@pytest.mark.slow
def test_lost_node_is_relaunched_and_training_resumes_bit_for_bit(chapter):
    _, _, results = chapter  # the run with --failover
    two_node = results["two_node"]
    for failover in (two_node["failover"], two_node["power_cut"]):  # killed, lost power
        assert failover["attempt"] == 1  # node a's torchrun restarted its ranks once
        assert failover["resumed_from_step"] is not None  # from a checkpoint, not from step 0
        assert failover["max_abs_diff"] == 0.0  # 4 ranks on gloo: the same sums, same order
        # one after the other: the old ranks end, the new ones start, the resumed run ends
        assert failover["detected_s"] < failover["restarted_s"] < failover["recovery_s"]
        assert failover["keep_alive_s"] == ch10.KEEP_ALIVE_S * ch10.KEEP_ALIVE_ATTEMPTS
    # a killed node's kernel closes its connections; after a power cut nothing arrives, and
    # node a's ranks learn of the loss only when their collective times out
    assert "by peer" in two_node["failover"]["node_a_heard"], two_node["failover"]
    assert "imed out" in two_node["power_cut"]["node_a_heard"], two_node["power_cut"]
    assert not leftovers("ddpl-"), leftovers("ddpl-")
