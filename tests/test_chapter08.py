"""Chapter 08, the bug lab: every bug still shows its symptom under this torch, every fix runs
clean, and nothing is left running.  One --quick run (its own process group) serves most checks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PROVENANCE_KEYS, REPO, load_results, run_script

from ddplab.bugs.catalog import BY_NAME, KINDS, SCENARIOS
from ddplab.bugs.runner import FOLLOW_ON

SCRIPT = "scripts/chapter08_bug_lab.py"
NAMES = [sc.name for sc in SCENARIOS]

# What each silent bug's giveaway must read, broken and fixed (the numbers the page explains).
GIVEAWAYS = {
    "checkpoint_silent": (lambda g: g > 1e-3, lambda g: g < 1e-5),
    "every_rank_saves": (lambda g: g < 2, lambda g: g == 2),
    "sampler_set_epoch": (lambda g: g == 2, lambda g: g == 0),
    "same_augmentation": (lambda g: g == 1.0, lambda g: g < 0.5),
    "accumulation_no_sync": (lambda g: g == 4, lambda g: g == 1),
    "local_norm_clip": (lambda g: g > 1e-4, lambda g: g < 1e-5),
}


def group_members(pgid: int) -> list[str]:
    """Processes still in process group ``pgid`` (by /proc, not by name): 'pid state cmd'."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended while we looked
            continue
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[2]) == pgid:
            command = text[text.index("("):text.rindex(")") + 1]
            left.append(f"{stat.parent.name} {fields[0]} {command}")
    return left


def run_in_own_group(*argv: str, timeout: float = 300):
    """Run the script as the leader of a new process group; return (proc, out, err, leftovers).

    Everything it starts (ranks, py-spy, multiprocessing's helpers) joins that group, so the
    group must be empty shortly after the script exits.
    """
    proc = subprocess.Popen([sys.executable, SCRIPT, *argv], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out, err = proc.communicate(timeout=timeout)
    deadline = time.monotonic() + 10  # a helper may take a moment to notice its parent is gone
    while (left := group_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc, out, err, left


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("ch08")
    proc, stdout, stderr, left = run_in_own_group("--quick", "--out", str(out))
    assert proc.returncode == 0, stderr[-3000:]
    return stdout, stderr, left, load_results(out, 8), out


def run_in_process(capsys, *argv: str) -> tuple[int, str, str]:
    """The script's main, in this process (no ranks are started for these): code, out, err."""
    import chapter08_bug_lab as lab

    import ddplab

    code = ddplab.run_main(lab.main, list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_list_shows_at_least_twelve_reproduced_scenarios(capsys):
    code, out, err = run_in_process(capsys, "--list")
    assert code == 0, err
    rows = [line.split(None, 2) for line in out.splitlines()]
    reproduced = [r for r in rows if r[1] in KINDS]
    assert len(reproduced) >= 12 and len({r[0] for r in reproduced}) == len(reproduced)
    assert [r[0] for r in reproduced] == NAMES
    assert all(r[1] == "gpu" and "not reproduced on this machine" in r[2]
               for r in rows if r[1] not in KINDS)


def test_the_list_runs_from_the_command_line():
    run = run_script(SCRIPT, "--list")
    assert run.returncode == 0 and run.stdout.split()[0] == NAMES[0], run.stderr


@pytest.mark.slow
def test_quick_run_records_every_scenario(quick):
    stdout, _, _, results, out = quick
    assert results["provenance"].keys() >= PROVENANCE_KEYS
    assert results["provenance"]["quick"] is True and results["diagnoses_run"] is False
    assert set(results["scenarios"]) == set(NAMES)
    for name, r in results["scenarios"].items():
        assert r["kind"] in KINDS
        assert r["first_line"], name
        assert r["seconds_to_symptom"] >= 0
        assert (out / "chapter08" / f"fix_{name}.diff").is_file()
    assert f"{len(NAMES)} of {len(NAMES)} bugs reproduced, {len(NAMES)} fixes ran clean" in stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_broken_version_shows_its_symptom(quick, name):
    r = quick[3]["scenarios"][name]
    sc = BY_NAME[name]
    assert r["reproduced"], f"{name}: the bug did not show: {r['broken']}"
    if sc.kind == "silent":
        broken_ok, _ = GIVEAWAYS[name]
        assert broken_ok(r["giveaway"]), f"{name}: giveaway {r['giveaway_text']!r}"
        return
    seen = [*r["broken"]["lines"], *r["broken"]["errors"].values()]
    assert any(sc.expect in line for line in seen), (
        f"{name}: expected {sc.expect!r} in the symptom; this torch printed:\n" + "\n".join(seen))
    if sc.kind == "hang":  # ended by the scenario's short group timeout, not a default
        assert r["seconds_to_symptom"] < 3 * quick[3]["hang_timeout_s"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_fixed_version_runs_clean(quick, name):
    r = quick[3]["scenarios"][name]
    assert r["fixed_clean"], f"{name}: the fix did not run clean: {r['fixed']}"
    if name in GIVEAWAYS:
        _, fixed_ok = GIVEAWAYS[name]
        assert fixed_ok(r["giveaway_fixed"]), f"{name}: {r['giveaway_text_fixed']!r}"


@pytest.mark.slow
def test_the_crash_names_the_rank_that_failed_first(quick):
    r = quick[3]["scenarios"]["rank_crash"]["broken"]
    assert r["root_cause"].startswith("rank 1 failed") and "out of bounds" in r["root_cause"]
    # rank 0 only saw its peer go away (when it had time to say so before being stopped):
    # gloo says so as 'closed' or 'reset' by peer, depending on how the socket ended
    if "0" in r["errors"]:
        assert any(follow_on in r["errors"]["0"] for follow_on in FOLLOW_ON), r["errors"]["0"]


@pytest.mark.slow
def test_mismatched_shapes_hangs_one_rank_and_misleads_the_other(quick):
    r = quick[3]["scenarios"]["mismatched_shapes"]["broken"]
    assert list(r["errors"]) == ["1"]  # rank 0 returned, with a sum over 3 of rank 1's values
    assert r["value"] == {"rank 0 got": [0.0, 2.0, 4.0]}


@pytest.mark.slow
def test_no_process_is_left_behind(quick):
    _, stderr, left, _, _ = quick
    assert left == [], f"still running after the lab: {left}"
    assert "Traceback" not in stderr  # every failure was on purpose, and caught


@pytest.mark.slow
def test_the_lab_under_torchrun(tmp_path):
    """Same code under torchrun; the crash, which needs its own launch, is skipped there."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", SCRIPT, "--quick", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = load_results(tmp_path, 8)
    assert results["provenance"]["launcher"] == "torchrun"
    for name, r in results["scenarios"].items():
        skipped = r["broken"].get("skipped")
        assert (name == "rank_crash") == bool(skipped), name
        assert r["fixed_clean"] and (r["reproduced"] or skipped), name
    assert "(1 skipped under torchrun)" in proc.stdout


@pytest.mark.slow
def test_one_bug_on_its_own(tmp_path):
    proc, out, err, left = run_in_own_group("--bug", "unused_parameter", "--out", str(tmp_path))
    assert proc.returncode == 0, err
    assert "Expected to have finished reduction in the prior iteration" in out
    assert "reproduced" in out and left == []
    assert not (tmp_path / "chapter08").exists()  # a single bug writes no results


def test_a_bug_before_any_rank_and_its_fix(capsys):
    code, out, err = run_in_process(capsys, "--bug", "dist_before_init")
    assert code == 0, err
    assert "Default process group has not been initialized" in out and "reproduced" in out
    code, out, err = run_in_process(capsys, "--bug", "dist_before_init", "--fixed")
    assert code == 0 and "ran clean" in out, err


@pytest.mark.parametrize("argv, says", [
    (["--bug", "no_such_bug"], "no such scenario"),
    (["--fixed"], "--fixed needs --bug"),
    (["--world-size", "1"], "2 ranks"),
])
def test_bad_flags_are_one_clear_line(capsys, tmp_path, argv, says):
    code, _, err = run_in_process(capsys, *argv, "--out", str(tmp_path))
    assert code == 2
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_committed_diffs_are_the_code():
    import chapter08_bug_lab as lab

    for sc in SCENARIOS:
        committed = REPO / "figures" / "chapter08" / f"fix_{sc.name}.diff"
        assert committed.read_text() == lab.fix_diff(sc), (
            f"{committed.name} is stale: run `make run-chapter08`")


def test_committed_results_come_from_a_full_run():
    results = json.loads((REPO / "figures" / "chapter08" / "results.json").read_text())
    assert results["diagnoses_run"] is True
    assert set(results["scenarios"]) == set(NAMES)
    for name, r in results["scenarios"].items():
        assert r["reproduced"] and r["fixed_clean"], name
    flight = results["scenarios"]["one_rank_collective"]["diagnosis_output"]["flight_recorder"]
    assert any("COLLECTIVE_TYPE_MISMATCH" in line for line in flight["torchfrtrace"])
