"""How fast `mantra plan --search` answers: wall time, candidates per second and peak RSS for llama3-8b on 8 and
64 H100s and llama3-70b on 64, 256 and 1024 (80 GiB each), every case in a fresh process.

    python bench/plan_search.py                                   # one JSON line per case, then a summary line
    python bench/plan_search.py --only llama3-8b:8 --repeats 1    # one case, once
    python bench/plan_search.py --out bench/results/plan_search-2026-12-03.jsonl

Per case, `--repeats` fresh processes (no cache warm from an earlier search), the fastest reported:
`search_s`, the search itself (trainer.plan.search.search: load, enumerate, bound, evaluate, confirm the
winners); `process_s`, the whole process (start, imports, the search), as `mantra plan --search` takes it; `peak_rss_mb`, the process's peak resident memory;
`candidates_per_s`, the layouts the rules accept over `search_s`. The goal (issue 29, on 2 cores): a 70B search
in 5 s or less, an 8B search in 1 s or less, peak RSS at most 300 MB; `within_goal` says whether each case met it.
The search runs on one thread, so on an idle machine its wall time is its CPU time (`search_cpu_s`); on a shared
one the wall time grows with the load average recorded with each line, and `within_goal_cpu` judges by CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("llama3-8b:8", "llama3-8b:64", "llama3-70b:64", "llama3-70b:256", "llama3-70b:1024")
GOAL_S = {"llama3-8b": 1.0, "llama3-70b": 5.0}
GOAL_RSS_MB = 300
GPU_MEM = 80


def _case(case: str) -> dict:
    """Run in the child: one search, cold (a fresh process: no cache of an earlier search); its time, counts and
    peak RSS."""
    began = time.perf_counter()
    from trainer.plan.search import search

    imported = time.perf_counter() - began
    name, gpus = case.split(":")
    t0, c0 = time.perf_counter(), time.process_time()
    found = search(ROOT / "manifests" / f"{name}.yaml", gpus=int(gpus), gpu_mem=GPU_MEM, device="h100")
    searched, cpu = time.perf_counter() - t0, time.process_time() - c0
    c = found.counts
    best = found.best[0] if found.best else None
    return {"search_s": round(searched, 4), "search_cpu_s": round(cpu, 4), "import_s": round(imported, 3),
            "candidates": c["candidates"], "pruned_memory": c["pruned_memory"], "pruned_time": c["pruned_time"],
            "evaluated": c["evaluated"], "fit": c["fit"], "refused_by_rules": sum(c["refused_by_rules"].values()),
            "best_step_s": best.estimate.timing.step_s if best else None,
            "best": list(best.overrides) if best else None,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def _child(case: str) -> tuple[float, dict]:
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", case], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
    return time.perf_counter() - began, json.loads(proc.stdout.strip().splitlines()[-1])


def measure(case: str, repeats: int) -> dict:
    """One case, `repeats` times, each in a fresh process (its peak RSS its own, no cache warm): the fastest."""
    runs = [_child(case) for _ in range(repeats)]
    process, row = min(runs, key=lambda r: r[1]["search_s"])
    name, gpus = case.split(":")
    search_s, rss = row["search_s"], max(r["peak_rss_mb"] for _, r in runs)
    return {"bench": "plan_search", "case": case, "manifest": f"manifests/{name}.yaml", "gpus": int(gpus),
            "gpu_mem_gib": GPU_MEM, "device": "h100", "date": time.strftime("%Y-%m-%d"),
            "load_average": round(os.getloadavg()[0], 2), "cores": os.cpu_count(), "search_s": search_s,
            "search_runs_s": [r["search_s"] for _, r in runs], "process_s": round(process, 3),
            "candidates_per_s": round(row["candidates"] / search_s), **row,
            "peak_rss_mb": rss, "goal_s": GOAL_S[name], "within_goal": search_s <= GOAL_S[name] and rss <= GOAL_RSS_MB,
            "within_goal_cpu": row["search_cpu_s"] <= GOAL_S[name] and rss <= GOAL_RSS_MB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=CASES, help="a case (repeatable; default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per case; the fastest is reported")
    parser.add_argument("--out", help="append the JSON lines to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(_case(args.child)))
        return
    rows = [measure(case, args.repeats) for case in args.only or CASES]
    summary = {"bench": "plan_search", "summary": True, "cases": len(rows),
               "max_search_s": {n: max((r["search_s"] for r in rows if r["manifest"].endswith(f"{n}.yaml")), default=None)
                                for n in GOAL_S},
               "max_peak_rss_mb": max(r["peak_rss_mb"] for r in rows), "all_within_goal": all(r["within_goal"] for r in rows),
               "all_within_goal_cpu": all(r["within_goal_cpu"] for r in rows)}
    lines = [json.dumps(r) for r in [*rows, summary]]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
