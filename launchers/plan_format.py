"""How `mantra plan` prints a plan's numbers: durations in the unit that shows their digits, a layout on one line
(read by launchers/plan.py and launchers/plan_search.py).

    duration(0.338)        # "338 ms"
    layout_line(estimate)  # "dp_replicate 1 x dp_shard 8 x tp 1 x pp 1; zero3; recompute selective; ..."
"""

from __future__ import annotations

from trainer.plan import Estimate


def duration(seconds: float) -> str:
    """A time in the unit that shows its digits: 1.23 s, 45.6 ms, 789 µs (never 0.000 s)."""
    if seconds == 0:
        return "0"
    if seconds >= 1:
        return f"{seconds:,.3g} s" if seconds < 100 else f"{seconds:,.0f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def layout_line(e: Estimate) -> str:
    lay = e.layout
    split = "" if lay.get("stage_split") in (None, "uniform") else f", {lay['stage_split']} {lay['stage_layers']}"
    pp = (f"pp {lay['pp']} ({lay['schedule']}, {lay['virtual_stages']} chunk{'s' if lay['virtual_stages'] > 1 else ''}"
          f"{split})" if lay["pp"] > 1 else "pp 1")
    sp = " + sp" if lay["sequence_parallel"] else ""
    cp = f" x cp {lay['cp']}" if lay.get("cp", 1) > 1 else ""
    ep = f" (ep {lay['ep']} of them)" if lay.get("ep", 1) > 1 else ""
    return (f"dp_replicate {lay['dp_replicate']} x dp_shard {lay['dp_shard']}{ep}{cp} x tp {lay['tp']}{sp} x {pp}; "
            f"{lay['optimizer_sharding']}; recompute {lay['recompute']}; global batch {lay['global_batch']} = "
            f"micro {lay['micro_batch']} x {lay['microbatches']} microbatches x dp {lay['dp_replicate'] * lay['dp_shard']}")
