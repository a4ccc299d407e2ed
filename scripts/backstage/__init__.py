"""backstage: one chapter's plumbing that is not its story.

``backstage/chapterNN.py`` (or ``chapterNN_<what>.py`` where a chapter has several) is imported
only by ``scripts/chapterNN_*.py``, by another backstage module of the same chapter and by tests;
a page never lists it.

    chapter03.py           the ring's summary: correctness, stalls, per-call costs, verdicts
    chapter04.py           what a bucket-size sweep shows against its own noise
    chapter05_report.py    chapter 05's summary and verdicts, read by the launching process
    chapter05_timing.py    the data-parallel variants timed fairly, side by side
    chapter06_workbench.py the models, each rank's batch, a recorded window of steps, traces
    chapter06_report.py    rank 0's measurements turned into results.json, and a summary
    chapter06_syncbn.py    BatchNorm against SyncBatchNorm: what the sync points cost
    chapter07_report.py    around the runs: flags, work directory, results.json, summary
    chapter07_restart.py   a run that dies and is restarted by torchrun, and its event log
    chapter10_report.py    flags, node failures, results.json and the summary of chapter 10
    chapter10_verdicts.py  what chapter 10's numbers say, computed for its page
    chapter11_probe.py     what chapter 11 records while sharded models train
    chapter11_report.py    chapter 11's summary and verdicts
    chapter11_bench.py     sharding's benchmark for ``make bench`` (imported by tools/bench.py)
"""
