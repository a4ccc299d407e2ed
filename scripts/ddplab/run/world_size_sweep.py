"""A sweep over world sizes: one launch per world size, one after the other, one rule for which.

``sweep_sizes`` is the rule (chapters 05 and 09 use it); ``launch_per_world_size`` runs a
worker at each size, reusing the main run's result at its own size when the caller has it in
the worker's shape.  Chapter 05's ``sweep_world_sizes`` turns the step times its
``throughput_worker`` returns into samples per second and scaling efficiency.
"""

from __future__ import annotations

from typing import Any

import torch

from .cli import with_changes
from .launch import Run, launch

SKIPPED_UNDER_TORCHRUN = ("under torchrun the processes are the ranks: a script cannot start "
                          "other world sizes. Run it with python to get the sweep.")


def sweep_sizes(main_world: int, backend: str, quick: bool) -> list[int]:
    """The world sizes a sweep runs: 1, 2 and 4 ranks (on GPUs: 1, 2, 4, 8 up to one rank per
    GPU, and all of them).  --quick: 1 and the main run's own; two points are enough to draw,
    and each extra launch costs seconds of start-up."""
    if quick:
        return sorted({1, main_world})
    gpus = torch.cuda.device_count() if backend == "nccl" else 0
    return sorted({1, 2, 4} if not gpus else {1, gpus} | {n for n in (2, 4, 8) if n <= gpus})


def launch_per_world_size(args, main_run: Run, worker, main: Any = None,
                          **changes) -> dict[int, Any] | None:
    """Rank 0's result of ``worker`` at each world size of ``sweep_sizes`` (the flags are
    ``args`` with ``changes``); ``main``, if given, stands for the main run's own size.  None
    under torchrun, where the processes are the ranks."""
    prov = main_run.provenance
    if prov["launcher"] == "torchrun":
        return None
    results = {}
    for world_size in sweep_sizes(prov["world_size"], prov["backend"], args.quick):
        if world_size == prov["world_size"] and main is not None:
            results[world_size] = main
        else:
            results[world_size] = launch(worker, with_changes(
                args, world_size=world_size, **changes)).result
    return results


def sweep_world_sizes(args, main_run: Run, main_result: dict, worker, swept: tuple,
                      batch: int) -> dict:
    """Samples per second at each world size of ``sweep_sizes``, all measured the same way
    (with --quick the main run's own size reuses its timing, when it had one thread per rank).

    On CPU every rank gets one thread, so that adding a rank adds a worker, as adding a GPU
    would.
    """
    prov = main_run.provenance
    gpus = torch.cuda.device_count() if prov["backend"] == "nccl" else 0
    one_thread_per_rank = gpus or prov["cpu_count"] // prov["world_size"] <= 1
    main = ({k: main_result["step_time_ms"][k] for k in swept}
            if args.quick and one_thread_per_rank else None)
    times = launch_per_world_size(args, main_run, worker, main)
    if times is None:
        return {"skipped": SKIPPED_UNDER_TORCHRUN}
    points = [{"world_size": world_size, "step_time_ms": ms,
               "samples_per_s": {k: world_size * batch / (v / 1e3) for k, v in ms.items()}}
              for world_size, ms in times.items()]
    one_rank = points[0]["samples_per_s"]["local"] / points[0]["world_size"]
    for p in points:  # against perfect scaling of one rank that never communicates
        p["efficiency"] = {k: v / (p["world_size"] * one_rank)
                           for k, v in p["samples_per_s"].items()}
    return {"per_rank_batch": batch, "cpu_count": prov["cpu_count"],
            "threads_per_rank": None if gpus else 1, "points": points}
