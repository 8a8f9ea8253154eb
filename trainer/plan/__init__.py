"""`mantra plan`: memory per rank, FLOPs, step time and pipeline bubble before a GPU is reserved.

    from trainer.manifest import load_manifest
    from trainer.plan import estimate
    run, _ = load_manifest("manifests/llama3-8b.yaml")
    plan = estimate(run, "h100")
    print(plan.verdict)

Torch-free (a test checks it): model.py (the PlanModel: what the planner needs of a
decoder, given by its kind's ModelSpec.plan; every module below reads it, none a kind's
config), devices.py (the hardware table), shapes.py (how layouts cut the
parameters), activations.py (what a block saves),
memory.py (bytes per rank over a step), flops.py (FLOPs and step time),
estimate.py (all of it for one resolved manifest), search.py (layouts that fit).
"""

from trainer.plan.devices import DEVICES, Device, device_names, get_device
from trainer.plan.estimate import Estimate, RankRow, estimate

__all__ = ["DEVICES", "Device", "Estimate", "RankRow", "device_names", "estimate", "get_device"]
