"""Checkpoints: what a run saves, how it proves the bytes are its own, and how it gets them back.

    checkpointer.py   the Checkpointer: save (sync or async), atomic commit, keep-N, resume with fallback
    resume.py         which checkpoint to resume from, and reading one on this rank as hostile
    storage.py        DCP storage of our own: raw tensor chunks, checksummed as written, verified as read
    shard_file.py     one shard written past the page cache (O_DIRECT) where the filesystem allows
    staging.py        the host copies an async save writes from (a shared memfd arena for a writer process)
    background.py     an async save's write and commit, off the training thread
    writer_process.py the byte work of an async save in a process at nice 19 (checkpoint.async_writer)
    finite.py         whether a state holds NaN or inf (never committed)
    dcp_metadata.py   DCP's metadata as our JSON (metadata.json), bounded and checked when read back
    values.py         the optimizer's plain values (lr, betas, ...) as small tensors, so DCP sees tensors only
    trainer_state.py  trainer.json (step, LR schedule, data position, counters) and RNG states (safetensors)
    plain.py          JSON read from a checkpoint: size, depth and value count bounded before parsing
    integrity.py      per-file checksums recorded in COMMITTED, verified at load
    prune.py          checkpoint.keep along the chain of loadable checkpoints; nothing else is deleted
    preflight.py      is the checkpoint directory usable, found at start
    paths.py          where a checkpoint may be: step directories inside the root, never outside
    export.py         a checkpoint as a Hugging Face model directory (`mantra export --to hf`)
    saves.py          the loop's checkpoints: the state a save holds, the cadence, the save before a stop

No file of a checkpoint is ever unpickled (tests/test_checkpoint_trust.py greps this package for it).

Import the module you need (`from trainer.checkpoint.checkpointer import Checkpointer`): this package
imports nothing, so the torch-free parts (paths, preflight) stay torch-free for the launchers.
"""
