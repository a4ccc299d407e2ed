"""The cluster recipes agree with each other and with the page: the manifest sets what
cluster.env sets (and nothing cluster.env warns against), restarts failed containers within a
budget, and the SLURM script's rendezvous ports stay below Linux's ephemeral range."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EPHEMERAL_FIRST = 32768  # net.ipv4.ip_local_port_range's default lower end


def manifest_env() -> dict[str, str]:
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load((REPO / "recipes/pytorchjob.yaml").read_text())
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    return {item["name"]: str(item["value"]) for item in container["env"]}


def test_manifest_mirrors_cluster_env():
    exported = set(re.findall(r"^export (\w+)=", (REPO / "recipes/cluster.env").read_text(),
                              re.MULTILINE))
    env = manifest_env()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env  # torch's default 3; 1 can hang
    assert set(env) <= exported, set(env) - exported
    assert {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} <= set(env)


def test_manifest_restarts_failed_containers_within_a_budget():
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load((REPO / "recipes/pytorchjob.yaml").read_text())
    policies = {spec["restartPolicy"] for spec in job["spec"]["pytorchReplicaSpecs"].values()}
    assert policies == {"OnFailure"}  # what the page says happens to a failed rank
    assert job["spec"]["runPolicy"]["backoffLimit"] > 0


def test_rendezvous_ports_stay_below_the_ephemeral_range():
    text = (REPO / "recipes/slurm_ddp.sbatch").read_text()
    base, span = map(int, re.search(r"\$\(\((\d+) \+ SLURM_JOB_ID % (\d+)\)\)", text).groups())
    assert base >= 1024 and base + span - 1 < EPHEMERAL_FIRST
