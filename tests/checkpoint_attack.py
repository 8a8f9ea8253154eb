"""Resume from attacked checkpoints in a process of their own, and report what each attempt did.

    python tests/checkpoint_attack.py MANIFEST CASES_JSON   # CASES_JSON: [{"name", "root", "verify"}, ...]
    -> one JSON line on stdout: {"cases": {name: {"step", "seconds", "warnings"}}, "patched": [...],
                                 "imported": [...], "max_rss_bytes": N}

Each case builds nothing new: one tiny model, optimizer, LR schedule and loader (`build_local`, the same as
tests/test_checkpoint_pickles.py's fixture) load the newest loadable checkpoint of the case's root through
the Checkpointer, as `mantra run` does. After all cases it reports whether any class in `pathlib` changed
(a pickle's BUILD can set attributes on a class), which watched modules got imported, and the peak RSS of
the process (ru_maxrss: the whole process's peak, model included), so one run bounds every case.
"""

from __future__ import annotations

import json
import logging
import pathlib
import resource
import sys
import time
from pathlib import Path

WATCHED_MODULES = ("torch._inductor", "torch.utils.benchmark", "this")  # what the payloads name


def build_local(manifest: Path):
    """A tiny model after one real AdamW step (so the optimizer has state), its sync, LR schedule and loader."""
    import torch

    from trainer.assemble import build_model
    from trainer.data.loader import build_loader
    from trainer.loop import train_step
    from trainer.manifest import load_manifest
    from trainer.optim import build_lr_schedule, build_optimizer
    from trainer.parallel.data.sync import LocalSync

    run, _ = load_manifest(manifest)
    m, device = run.manifest, torch.device("cpu")
    model = build_model(run, None, device)
    sync = LocalSync(model, build_optimizer(list(model.named_parameters()), m.optimizer, device))
    schedule = build_lr_schedule(sync.optimizer, m.optimizer, m.train.steps)
    loader = build_loader(m.data, seq_len=m.model.seq_len, vocab=m.model.vocab, seed=0,
                          global_batch=run.batch.global_batch, micro_batch=run.batch.micro_batch,
                          microbatches=run.grad_accum, dp_rank=0, dp_size=1)
    train_step(model, sync, loader.microbatches(0), device, torch.autocast("cpu", enabled=False), 1, run.grad_accum)
    sync.step()
    return model, sync, schedule, loader


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _classes() -> dict[str, dict]:
    return {name: dict(vars(cls)) for name, cls in vars(pathlib).items() if isinstance(cls, type)}


def main(manifest: Path, cases: list[dict]) -> dict:
    import torch

    from trainer.checkpoint.checkpointer import Checkpointer

    model, sync, schedule, loader = build_local(manifest)  # (building a model imports torch._inductor on 2.13)
    before = _classes()
    imported_before = [m for m in WATCHED_MODULES if m in sys.modules]
    collect = _Collect()
    logging.getLogger("trainer").addHandler(collect)
    results = {}
    for case in cases:
        collect.lines.clear()
        start = time.perf_counter()
        ckpt = Checkpointer(Path(case["root"]), keep=3, rank=0, world_size=1, device=torch.device("cpu"),
                            verify=case["verify"])
        try:
            resumed = ckpt.load_latest(None, sync, model, schedule, loader)
            step = resumed.step if resumed else None
        except Exception as exc:  # reported, not raised: the other cases still run
            step = f"{type(exc).__name__}: {exc}"
        results[case["name"]] = {"step": step, "seconds": time.perf_counter() - start, "warnings": list(collect.lines)}
    after = _classes()
    return {"cases": results, "patched": sorted(n for n in before if after.get(n) != before[n]),
            "imported_before": imported_before,
            "imported": [m for m in WATCHED_MODULES if m in sys.modules and m not in imported_before],
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(json.dumps(main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))))
