"""Checkpoints: what a run saves, how it proves the bytes are its own, and how it gets them back.

    checkpointer.py   the Checkpointer: save (sync or async), atomic commit, keep-N, resume with fallback
    resume.py         which checkpoint to resume from, and reading one on this rank as hostile
    storage.py        DCP storage that checks every byte it reads and checksums what it writes
    integrity.py      per-file checksums recorded in COMMITTED, verified at load
    preflight.py      is the checkpoint directory usable, found at start
    paths.py          where a checkpoint may be: step directories inside the root, never outside
    safe_unpickle.py  the restricted unpickler for DCP's `.metadata`
    export.py         a checkpoint as a Hugging Face model directory (`mantra export --to hf`)
    saves.py          the loop's checkpoints: the state a save holds, the cadence, the save before a stop

Import the module you need (`from trainer.checkpoint.checkpointer import Checkpointer`): this package
imports nothing, so the torch-free parts (paths, preflight) stay torch-free for the launchers.
"""
