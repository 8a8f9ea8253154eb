"""Simulated pipeline schedules: makespan, bubble rate and peak activations, no torch, no GPU.

    python bench/pipeline_simulated.py                 # one JSON line per schedule, p=4, m=8, T_F=T_B=T_W=1
    python bench/pipeline_simulated.py --grid          # p in {2,4,8} x m in {8,16,32}
    python bench/pipeline_simulated.py --table         # the same grid as a Markdown table
    python bench/pipeline_simulated.py --f 1 --b 2 --w 1 --comm 0.1 --p2p blocking

Times are per rank and microbatch (a chunk of a 2-chunk schedule costs half).
`bubble_rate` is the idle share of one step, ramp included; `span_bubble_rate`
the idle share within the longest rank's own busy window (what steps
overlapped back to back would leave; mantra does not overlap steps).
interleaved-1f1b and zb-v run with virtual_stages=2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.parallel.pipeline import Costs, build_schedule, schedule_names, simulate  # noqa: E402

ORDER = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v"]
VIRTUAL = {"interleaved-1f1b": 2, "zb-v": 2}


def measure(name: str, pp: int, microbatches: int, costs: Costs, p2p: str) -> dict[str, object]:
    result = simulate(build_schedule(name, pp, microbatches, VIRTUAL.get(name, 1)), costs, p2p)
    line = result.summary()
    line.update(T_F=costs.f, T_B=costs.b, T_W=costs.w, T_comm=costs.comm, p2p=p2p)
    return line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--f", type=float, default=1.0)
    parser.add_argument("--b", type=float, default=1.0)
    parser.add_argument("--w", type=float, default=1.0)
    parser.add_argument("--comm", type=float, default=0.0)
    parser.add_argument("--p2p", choices=["async", "blocking"], default="async")
    parser.add_argument("--grid", action="store_true", help="p in {2,4,8} x m in {8,16,32}, JSON lines")
    parser.add_argument("--table", action="store_true", help="the grid as a Markdown table")
    args = parser.parse_args(argv)
    costs = Costs(args.f, args.b, args.w, args.comm)
    names = [n for n in ORDER if n in schedule_names()]
    shapes = [(p, m) for p in (2, 4, 8) for m in (8, 16, 32)] if args.grid or args.table else [(args.pp, args.microbatches)]
    if args.table:
        print("| p | m | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
    for pp, m in shapes:
        lines = [measure(name, pp, m, costs, args.p2p) for name in names]
        if args.table:
            cells = [f"{x['makespan']:g} / {100 * x['bubble_rate']:.1f}% / {max(x['peak_activation']):g}" for x in lines]
            print(f"| {pp} | {m} | " + " | ".join(cells) + " |")
        else:
            for line in lines:
                print(json.dumps(line))


if __name__ == "__main__":
    main()
