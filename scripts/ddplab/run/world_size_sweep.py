"""Throughput against world size: one launch per world size, all measured the same way.

Chapter 05's ``throughput_worker`` times a step of each variant in ``swept`` on every rank and
returns rank 0's median step times; ``sweep_world_sizes`` launches it for 1, 2, 4 ranks (or 1 …
all GPUs) and turns the times into samples per second and scaling efficiency.
"""

from __future__ import annotations

import argparse

import torch

from .launch import Run, launch


def sweep_world_sizes(args, main_run: Run, main_result: dict, worker, swept: tuple,
                      batch: int) -> dict:
    """Samples per second for 1, 2, 4 ranks (1 … all GPUs): each size is a launch of its own,
    one after the other, all measured the same way.  (With --quick: only 1 rank and the main
    run's world size, which reuses the main run's timing to save a launch.)

    On CPU every rank gets one thread, so that adding a rank adds a worker, as adding a GPU
    would.
    """
    prov = main_run.provenance
    if prov["launcher"] == "torchrun":
        return {"skipped": "under torchrun the processes are the ranks: a script cannot start "
                           "other world sizes. Run it with python to get the sweep."}
    gpus = torch.cuda.device_count() if prov["backend"] == "nccl" else 0
    sizes = sorted({1, 2, 4} if not gpus else {1, gpus} | {n for n in (2, 4, 8) if n <= gpus})
    if args.quick:  # two points are enough to draw; each extra launch costs seconds of start-up
        sizes = sorted({1, prov["world_size"]})
    one_thread_per_rank = gpus or prov["cpu_count"] // prov["world_size"] <= 1
    points = []
    for world_size in sizes:
        if args.quick and world_size == prov["world_size"] and one_thread_per_rank:
            ms = {k: main_result["step_time_ms"][k] for k in swept}
        else:
            sub = argparse.Namespace(**{**vars(args), "world_size": world_size})
            ms = launch(worker, sub).result
        points.append({"world_size": world_size, "step_time_ms": ms,
                       "samples_per_s": {k: world_size * batch / (v / 1e3)
                                         for k, v in ms.items()}})
    one_rank = points[0]["samples_per_s"]["local"] / points[0]["world_size"]
    for p in points:  # against perfect scaling of one rank that never communicates
        p["efficiency"] = {k: v / (p["world_size"] * one_rank)
                           for k, v in p["samples_per_s"].items()}
    return {"per_rank_batch": batch, "cpu_count": prov["cpu_count"],
            "threads_per_rank": None if gpus else 1, "points": points}
