"""ddplab.run: how a chapter runs.  It names no chapter and imports no concept of ddplab.

    launch.py     run a function on N ranks (mp.spawn or torchrun), clean failures
    fork_server.py  where a script's ranks come from: spawned, or forked from a server (CPU, Linux)
    first_failure.py  which rank failed first: its claim in the store, follow-on errors
    entry.py      a chapter's main: every failure as one clear last line and an exit code
    chapter_main.py  run_chapter: --replot, or launch, finish, write the folder, print
    stopping.py   every exit path (error, hang, Ctrl-C, SIGTERM) ends every process it started
    cli.py        the flags every chapter shares, bad input as one clear line
    devices.py    --device/--backend: which backend, which device each rank computes on
    ranks.py      who am I: RankContext, get("rank"), seeding, progress bars, over-rank helpers
    results.py    results.json with provenance, staged chapter output
    replot.py     --replot: a chapter's figures drawn from its run's files, no rank started
    timing.py     fair step timing (warm-up, barriers, medians, A B A B)
    timeline.py   per-rank event timelines, Gantt charts, Chrome traces
    tracing.py    BucketTrace: BucketedDDP's buckets on a timeline (an observer, not woven in)
    plotting.py   the book's figure style (imports matplotlib: import it where you draw)
    memory.py     peak memory of one piece of work, on a GPU or on the CPU
    models.py     the book's small model and its synthetic data
    fitting.py    least squares for a cost model (non-negative, on relative error)
    hangs.py      jobs that hang on purpose: a short timeout, and where each rank was
    netns.py      two emulated machines: network namespaces joined by a rate-limited veth
    node_guard.py run a command inside an emulated node, end it with its launcher
    world_size_sweep.py  throughput against world size: one launch per size, measured alike
"""
