"""The share of the peak FLOP/s the step time assumes for compute: a small table of published runs per
device, precision and compile, each row naming its source (docs/plan-vs-published.md has the runs).

    c = default_calibration(get_device("h100"), bf16=True, compiled=False)
    c.efficiency, c.source      # 0.345, "torchtitan Llama 3.1 8B, eager bf16: ..."

A device without a row of its own takes the H100's row of the same precision and compile and says so;
`mantra plan --efficiency F` overrides the table, and `mantra plan --calibrate RUN_DIR` fits the efficiency
(and the seconds each pipeline action costs beyond its FLOPs) to a run this project measured
(trainer/plan/calibrate.py). Memory does not depend on any of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    """What the time model assumes beyond the device's datasheet."""

    efficiency: float  # achieved share of the dense peak for the model's compute
    action_overhead_s: float = 0.0  # seconds each pipeline action (F, B, W or BW) costs beyond its FLOPs
    source: str = ""  # where the efficiency comes from

    def to_json(self) -> dict[str, object]:
        return {"efficiency": self.efficiency, "action_overhead_s": self.action_overhead_s, "source": self.source}


@dataclass(frozen=True)
class Row:
    device: str  # trainer/plan/devices.py key
    precision: str  # bf16 | fp32
    compiled: bool  # train.compile
    efficiency: float
    source: str


# Each efficiency reproduces the published tokens/s with this plan's own step time (docs/plan-vs-published.md).
TABLE: tuple[Row, ...] = (
    Row("h100", "bf16", False, 0.345,
        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Llama 3.1 8B FSDP eager bf16: 5,762 tokens/s/GPU "
        "on 8 H100s (table 1) and 5,605 on 128 (table 3); plan at 0.345: 5,800 and 5,797"),
    Row("h100", "bf16", True, 0.40,
        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md table 1, Llama 3.1 8B FSDP with torch.compile, "
        "bf16: 6,667 tokens/s/GPU on 8 H100s; plan at 0.40: 6,708"),
    Row("cpu", "fp32", False, 0.5,
        "tiny-cpu's ~7,800 tokens/s on 2 cores (README) over the host's assumed fp32 peak"),
)


def default_calibration(device, bf16: bool, compiled: bool) -> Calibration:
    """The table's row for `device` at this precision and compile: its own, else the same precision's row with
    the other compile setting, else the H100's (bf16) or the CPU's (fp32), said in `source`."""
    precision = "bf16" if bf16 else "fp32"
    own = [r for r in TABLE if r.device == device.key and r.precision == precision]
    for rows, borrowed in ((own, False), ([r for r in TABLE if r.precision == precision], True)):
        if not rows:
            continue
        row = next((r for r in rows if r.compiled == compiled), rows[0])
        how = "compiled" if row.compiled else "eager"
        if borrowed:
            return Calibration(row.efficiency, 0.0, f"no published {device.key} {precision} row; {row.device}'s "
                               f"({how}): {row.source}")
        note = "" if row.compiled == compiled else f" (no {'compiled' if compiled else 'eager'} row; the {how} one)"
        return Calibration(row.efficiency, 0.0, f"{row.device} {precision} {how}{note}: {row.source}")
    return Calibration(0.5, 0.0, "no published row; assumed")
