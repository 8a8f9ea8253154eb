"""Reporting: what a run tells the people watching it.

    meter.py      the numbers of every logged step: throughput, MFU, memory
    sinks.py      console, JSONL, TensorBoard and W&B, each fed the same rows
    rows.py       one metrics row per final step: the meter's keys, the guards' counts, val_loss, the kind's keys
    progress.py   the live line between the console's log lines
    banner.py     what a run is about to do, printed once before step 1
    memtrack.py   live tensor bytes over time (`logging.memory: tensors`)
"""
