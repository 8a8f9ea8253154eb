"""Whether a run reads its `init:` section at all (torch-free: `mantra validate` asks it too).

    starts_from_init(manifest, checkpoint_dir)   # init set, no resume_from, no committed step of its own

A run that has a committed checkpoint of its own (an interrupted run, restarted) resumes from it, and `init`
is not read again: not by the ranks (trainer/init/weights.py), and not by the rules that check the Hugging
Face directory or init.checkpoint (trainer/manifest/rules/init.py), so removing or replacing the directory a
run started from does not stop it from resuming.
"""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.paths import committed_steps
from trainer.manifest.sections import ManifestSections


def starts_from_init(m: ManifestSections, checkpoint_dir: Path) -> bool:
    """init.hf or init.checkpoint is set, and neither checkpoint.resume_from nor a committed checkpoint of the
    run's own (in `checkpoint_dir`) says where it stands."""
    if not (m.init.hf or m.init.checkpoint) or m.checkpoint.resume_from:
        return False
    return not committed_steps(Path(checkpoint_dir))
