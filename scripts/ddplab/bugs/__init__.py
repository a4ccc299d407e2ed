"""The bug lab of chapter 08: real DDP failures as small broken/fixed function pairs.

    catalog.py      every scenario: kind, summary, the distinctive text, where PyTorch raises it
    ddp_errors.py   bugs DDP's constructor and reducer catch (unused parameters, checkpointing, ...)
    collectives.py  bugs in how ranks meet (hangs, mismatches, a crashing rank, the port, init)
    silent.py       bugs that raise nothing (sampler epochs, augmentation seeds, accumulation, ...)
    runner.py       run one scenario on every rank (or before any rank), caught and timed
    diagnose.py     the same bugs under the tools that find them (DEBUG levels, flight recorder,
                    py-spy, anomaly detection, c10d's log)
"""
