"""One GPU, under 8 minutes including compile: what mantra does on it, one JSON line per result.

    python bench/gpu_suite.py --out bench/results/gpu_suite-$(date +%F)-h200.jsonl   # on one GPU
    python bench/gpu_suite.py --cpu-smoke                                            # tiny shapes, CPU, < 2 min

Results, in order (each line also carries the torch and CUDA versions, the GPU's name and the date):
  throughput  mantra vs the plain compiled bf16 loop of bench/gpu_mfu.py on the 1.26B Llama
              (d2048, 22 layers, seq 2048, micro batch 8, fused AdamW): tokens/s, MFU and the ratio,
              with torch.compile off and on (gpu_mfu.py's runners, each in a fresh process).
  startup     seconds from spawning the process to the end of the first step, for the same runs.
  agreement   20 steps of a small byte-level Llama on the shipped text in bf16 (autocast over fp32
              master weights) and in fp32, same seed and data: the loss curves must agree within
              LOSS_RTOL; each precision's allocator peak sits beside `mantra plan`'s prediction.
  fit         the largest micro batch `mantra plan` says fits the 1.26B Llama on this GPU, trained for
              a few steps (peak beside the plan), then one more, which the plan says does not fit.

--cpu-smoke runs the same code with tiny shapes on the CPU, compile off (two cores compile too
slowly for the 2-minute budget; tests/test_cli.py compiles on the CPU), the live-tensor tracker
standing in for the CUDA allocator, and the host's memory as the plan's device with a capacity set
so that the fit search has an edge to find. tests/test_gpu_suite_smoke.py runs it.

Parts that would start past --budget-s are written as skipped rather than run, so a slow machine
still returns every line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_mfu  # noqa: E402  (bench/ is not a package: the shared runners and rows)

ROOT = gpu_mfu.ROOT
CORPUS = str(ROOT / "manifests" / "data" / "python-docs.txt")

# bf16 vs fp32 agreement, per step: |loss_bf16 - loss_fp32| <= LOSS_RTOL * loss_fp32.
# bf16 keeps 8 significant bits (unit round-off u = 2^-8 = 0.39%). Autocast rounds matmul inputs to
# bf16 and accumulates in fp32, so step 1 (same weights, same batch) differs by rounding alone: a
# fraction of u on the loss. Later steps also differ because the weights took slightly different
# updates; at these learning rates 20 steps keep that drift within a few u. 2% = ~5u allows that
# drift and still fails on what breaks mixed precision (a loss scaled or cast wrong, a layer left in
# bf16 that should accumulate in fp32, a gradient lost to underflow), which moves the loss by far
# more. The first step is held to FIRST_RTOL = 1%, since no drift has happened yet.
LOSS_RTOL = 0.02
FIRST_RTOL = 0.01
PLAN_RTOL = 0.10  # plan vs the allocator's peak (eager): reported, and flagged beyond this


@dataclass(frozen=True)
class Suite:
    """Shapes and step counts: the GPU's, or the CPU smoke's."""

    big: str  # a gpu_mfu.SHAPES key: the throughput and fit model
    compiles: tuple[bool, ...]
    steps: int  # throughput steps per run
    warmup: int  # steps left out of the median (compile)
    small: dict = field(default_factory=dict)  # the agreement model (byte-level, trained on CORPUS)
    small_batch: int = 16
    agreement_steps: int = 20
    agreement_lr: float = 1e-3
    fit_steps: int = 3
    fit_limit: int = 128  # micro batches searched: 1..fit_limit
    fit_capacity_gib: float | None = None  # None: the device's usable memory


GPU = Suite(big="b", compiles=(False, True), steps=10, warmup=3,
            small={"kind": "llama", "dim": 512, "layers": 8, "heads": 8, "ffn_dim": 1408, "vocab": 256, "seq_len": 1024})
SMOKE = Suite(big="smoke", compiles=(False,), steps=4, warmup=1,
              small={"kind": "llama", "dim": 64, "layers": 2, "heads": 4, "ffn_dim": 128, "vocab": 256, "seq_len": 64},
              small_batch=4, agreement_lr=3e-3, fit_steps=2, fit_limit=8, fit_capacity_gib=0.005)


class Budget:
    """Wall-clock seconds left of the suite's budget; a child process gets no more than what is left."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def header() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {"bench": "gpu_suite", "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "gpu": torch.cuda.get_device_name() if cuda else "cpu",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# -- throughput and start-up ------------------------------------------------------------------------------

def throughput(suite: Suite, device: str, budget: Budget):
    """Plain loop and mantra on the big model, compile off then on: a throughput row each, then start-up rows."""
    startup = []
    for compile_ in suite.compiles:
        plain = gpu_mfu.spawn(gpu_mfu.spec("plain", suite.big, suite.steps, suite.warmup, compile_), budget.left())
        mantra = gpu_mfu.spawn(gpu_mfu.spec("mantra", suite.big, suite.steps, suite.warmup, compile_), budget.left())
        for runner, r, ref in (("mantra", mantra, plain), ("plain", plain, None)):
            row = gpu_mfu.row(suite.big, runner, r, device, ref)
            yield {"result": "throughput", "compile": compile_, **_strip(row)}
            startup.append({"result": "startup", "runner": runner, "compile": compile_,
                            "first_step_s": round(r["first_step_s"], 2)})
    yield from startup


def _strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("bench", "date")}  # the header says those


# -- bf16 vs fp32 -----------------------------------------------------------------------------------------

def agreement(suite: Suite, device: str, budget: Budget):
    """The small Llama trained in fp32 and in bf16: a line per precision (peak vs plan), then the comparison."""
    runs = {}
    for precision in ("fp32", "bf16"):
        s = {"runner": "mantra", "name": f"suite-agreement-{precision}", "model": suite.small,
             "batch": suite.small_batch, "steps": suite.agreement_steps, "warmup": 1, "compile": False,
             "precision": precision, "lr": suite.agreement_lr, "data": {"source": "text", "path": CORPUS}}
        r = runs[precision] = gpu_mfu.spawn(s, budget.left())
        yield {"result": "memory", "precision": precision, **_memory(r)}
    ref, low = runs["fp32"]["losses"], runs["bf16"]["losses"]
    rel = [abs(b - a) / a for a, b in zip(ref, low)]
    yield {"result": "agreement", "steps": len(ref), "loss_fp32": [round(x, 5) for x in ref],
           "loss_bf16": [round(x, 5) for x in low], "max_rel_diff": round(max(rel), 6), "first_rel_diff": round(rel[0], 6),
           "rtol": LOSS_RTOL, "first_rtol": FIRST_RTOL, "learned": ref[-1] < ref[0],
           "ok": max(rel) <= LOSS_RTOL and rel[0] <= FIRST_RTOL and ref[-1] < ref[0]}


def _memory(r: dict) -> dict:
    measured, planned = r["peak_mem_bytes"], r["plan_peak_bytes"]
    diff = planned / measured - 1 if measured else None
    return {"peak_gib": round(measured / 2**30, 4), "plan_peak_gib": round(planned / 2**30, 4),
            "plan_vs_measured": None if diff is None else round(diff, 4),
            "plan_within_rtol": None if diff is None else abs(diff) <= PLAN_RTOL}


# -- the largest micro batch --------------------------------------------------------------------------------

def plan_fits(suite: Suite, device: str) -> tuple[dict[int, bool], float]:
    """{micro batch: whether `mantra plan` says it fits} for 1.. up to the first that does not (or fit_limit + 1),
    and the capacity (bytes) the plan compared against. Plan only: no torch, milliseconds each."""
    import tempfile

    import yaml

    from trainer.manifest import load_manifest
    from trainer.plan import estimate

    fits, capacity = {}, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for mb in range(1, suite.fit_limit + 2):
            path = Path(tmp) / "m.yaml"
            s = gpu_mfu.spec("mantra", suite.big, suite.fit_steps, 1, False, batch=mb)
            path.write_text(yaml.safe_dump(gpu_mfu.manifest(s, Path(tmp) / "run")))
            run, _ = load_manifest(path)
            plan = estimate(run, device, capacity_gib=suite.fit_capacity_gib, compare=False)
            fits[mb], capacity = plan.fits, plan.capacity
            if not plan.fits:
                break
    return fits, capacity


def fit(suite: Suite, device: str, budget: Budget):
    """Train the plan's largest micro batch (eager, as plan models), then one more; report what each did."""
    fits, capacity = plan_fits(suite, device)
    best = max((mb for mb, ok in fits.items() if ok and mb <= suite.fit_limit), default=0)
    if best == 0:
        yield {"result": "fit", "micro_batch": 0, "capacity_gib": round(capacity / 2**30, 4), "ran": False}
        return
    for mb in (best, best + 1):
        s = gpu_mfu.spec("mantra", suite.big, suite.fit_steps, 1, False, batch=mb, name=f"suite-fit-{mb}")
        line = {"result": "fit", "micro_batch": mb, "plan_fits": fits[mb], "capacity_gib": round(capacity / 2**30, 4)}
        try:
            r = gpu_mfu.spawn(s, budget.left())
        except RuntimeError as exc:
            oom = "out of memory" in str(exc).lower() or "OutOfMemoryError" in str(exc)
            yield {**line, "ran": False, "oom": oom, "error": str(exc).strip().splitlines()[-1][-300:]}
            continue
        yield {**line, "ran": True, "oom": False, "tokens_per_s": round(r["tokens_per_step"] / r["step_time_s"], 1),
               **_memory(r)}


# -- the suite ----------------------------------------------------------------------------------------------

PARTS = {"throughput": throughput, "agreement": agreement, "fit": fit}
RESERVE_S = {"throughput": 0, "agreement": 20, "fit": 20}  # the least a part needs to start (seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (the test's mode)")
    parser.add_argument("--out", type=Path, help="append the JSON lines here as they come")
    parser.add_argument("--budget-s", type=float, default=470.0, help="wall-clock budget; later parts are skipped")
    parser.add_argument("--only", choices=list(PARTS), action="append", help="run only these parts")
    args = parser.parse_args(argv)
    import torch

    device = gpu_mfu.device_key(torch)
    if device == "cpu" and not args.cpu_smoke:
        sys.exit("no GPU here: run with --cpu-smoke, or on a GPU machine")
    suite = SMOKE if args.cpu_smoke else GPU
    budget, head, failed = Budget(args.budget_s), header(), False
    for name in args.only or list(PARTS):
        if budget.left() < RESERVE_S[name] + 1:
            _emit({**head, "result": name, "skipped": f"the {args.budget_s:.0f} s budget ran out"}, args.out)
            continue
        start = time.monotonic()
        try:
            for line in PARTS[name](suite, device, budget):
                _emit({**head, **line}, args.out)
        except Exception as exc:  # noqa: BLE001  (one part failing still reports the others)
            failed = True
            _emit({**head, "result": name, "error": f"{type(exc).__name__}: {str(exc).strip()[-1500:]}"}, args.out)
        _emit({**head, "result": "part_time", "part": name, "seconds": round(time.monotonic() - start, 1)}, args.out)
    return 1 if failed else 0


def _emit(line: dict, out: Path | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
