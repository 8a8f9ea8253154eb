"""Every collective is bounded (issue 24): every process group of a rank, the subgroups the device mesh
creates included (torch gives those gloo's 30-minute default, not the world group's timeout), times out
within the run's budget: the warm-up's from init_distributed on, train.hang_timeout_s's (plus a grace) once
`bound_collectives` runs after the first step (trainer/run/watchdog.py). 4 real ranks, a 2 x 2 mesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = r"""
import json, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from trainer.dist import RankInfo, bound_collectives, init_distributed
from trainer.parallel.mesh import build_mesh

def group_timeouts():  # {group name: its backend's timeout, seconds}: torch's own bookkeeping, read-only
    world = torch.distributed.distributed_c10d._world
    return {name: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for group, name in list(world.pg_names.items())}


out, info = Path(sys.argv[1]), RankInfo.from_env()
init_distributed(info, torch.device("cpu"), 120)  # the warm-up budget
mesh = build_mesh({"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}, torch.device("cpu"))
warm = group_timeouts()
bound_collectives(3)  # the first step is over: train.hang_timeout_s plus its grace, say 3 s
later = dist.new_group([0, 1])  # a group made after it (post-validation's, the signal flag's)
steady = group_timeouts()
result = {"warm": warm, "steady": steady, "tp_ranks": dist.get_process_group_ranks(mesh["tp"].get_group())}
if info.rank == 0:  # its tp peer, rank 1, never joins: the subgroup's collective must time out, not wait 30 minutes
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=mesh["tp"].get_group())
        result["error"] = None
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["waited_s"] = time.monotonic() - began
(out / f"rank{info.rank}.json").write_text(json.dumps(result))
if info.rank == 1:
    time.sleep(20)
os._exit(0)
"""


def test_every_group_the_mesh_makes_is_bounded_by_the_run_and_a_lost_peer_times_out(tmp_path):
    script = tmp_path / "groups.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           str(script), str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["tp_ranks"] == [0, 1]
    assert len(rank0["warm"]) >= 4, rank0  # the world, the mesh's dp_shard and tp groups, the flattened dp
    assert set(rank0["warm"].values()) == {120.0}, rank0["warm"]
    assert len(rank0["steady"]) == len(rank0["warm"]) + 1 and set(rank0["steady"].values()) == {3.0}, rank0["steady"]
    print(f"\na tp subgroup's all-reduce without its peer failed after {rank0['waited_s']:.1f} s (bound: 3 s)")
    assert rank0["error"] is not None and rank0["waited_s"] < 15, rank0  # not gloo's 30 minutes
    for rank in (1, 2, 3):
        assert set(json.loads((tmp_path / f"rank{rank}.json").read_text())["steady"].values()) == {3.0}
