"""faulty: the llama kind with faults a test injects, for tests only (a plugin no manifest reaches unless a test
installs it: tests/faults_fixtures.py puts it on PYTHONPATH with its `mantra.models` entry point).

Numerically it is llama: the same modules, init and parallelize, so its losses are llama's. The faults
come from the environment variable MANTRA_TEST_FAULTS, read by this plugin alone: a JSON list of

    {"rank": 1, "step": 7, "do": "raise"}                 raise RuntimeError at the start of step 7, every attempt
    {"rank": 1, "step": 12, "do": "kill", "once": DIR}    SIGKILL this rank at the start of step 12
    {"rank": 1, "step": 12, "do": "stop", "once": DIR}    SIGSTOP this rank (a hang)
    {"rank": 1, "step": 12, "do": "wait", "once": DIR}    write DIR/at-r1-s12, then wait for DIR/go-r1-s12: the
                                                          test acts (kills a node) at a known step
    {"rank": 1, "do": "slow", "seconds": 0.05}            each forward of rank 1 takes that much longer

`once`: a directory where the fault leaves DIR/fired-r<rank>-s<step>; it never fires again (the restarted
attempt passes the step). The step is the loop's own: the hang watchdog's beat at the start of each step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Literal

from pydantic import Field

import trainer.models.llama as llama
from trainer.models.llama.config import LlamaConfig
from trainer.run import watchdog

LLAMA = llama.SPEC if hasattr(llama, "SPEC") else llama.llama_spec()  # the registry's entry, as either form names it

ENV = "MANTRA_TEST_FAULTS"


class FaultyConfig(LlamaConfig):
    kind: Literal["faulty"] = Field("faulty", description="llama with injected faults (tests only)")


def faults() -> list[dict]:
    return json.loads(os.environ.get(ENV, "[]"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def at_step(step: int) -> None:
    """The start of step `step` on this rank: fire what is due."""
    for fault in faults():
        if fault.get("rank") != rank() or fault.get("step") != step or fault["do"] == "slow":
            continue
        tag = f"r{rank()}-s{step}"
        once = Path(fault["once"]) if fault.get("once") else None
        if once is not None:
            if (once / f"fired-{tag}").exists():
                continue
            once.mkdir(parents=True, exist_ok=True)
            (once / f"fired-{tag}").write_text(str(time.time()))
        if fault["do"] == "raise":
            raise RuntimeError(f"injected fault at step {step} on rank {rank()}")
        if fault["do"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault["do"] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault["do"] == "wait":
            (once / f"at-{tag}").write_text(str(time.time()))
            while not (once / f"go-{tag}").exists():
                time.sleep(0.05)


_beat = watchdog.HangWatchdog.beat


def beat(self, step, phase):
    _beat(self, step, phase)
    if phase == "step" and step is not None:
        at_step(step)


watchdog.HangWatchdog.beat = beat


def parallelize(model, *args, **kwargs):  # llama's, whatever it is handed; then the slow rank's delay
    parts = LLAMA.parallelize(model, *args, **kwargs)
    delay = sum(f.get("seconds", 0.0) for f in faults() if f["do"] == "slow" and f.get("rank") == rank())
    if delay:
        for module in [parts.model] if parts.stages is None else list(parts.stages.values()):
            module.register_forward_hook(lambda *_: time.sleep(delay))  # inside the forward a rank is timed by
    return parts


SPEC = dataclasses.replace(LLAMA, name="faulty", description="llama with injected faults (tests only)",
                           config=FaultyConfig, parallelize=parallelize, hf=None)
