"""Data parallelism, one folder: every way the data-parallel ranks keep their gradients and optimizer in step.

    sync.py        the GradSync protocol the loop drives, LocalSync (one rank, tp only) and
                   PipelineLocalSync (pp without dp: the norm sums over the stages)
    buckets.py     the bucketed gradient reducer (padded, aligned fp32 buckets; all-reduce or reduce-scatter)
    zero.py        BucketSync: none / zero1 / zero2 over that reducer, with a sharded optimizer
    zero_state.py  BucketSync's checkpoint state in the layout-free form every GradSync uses
    fsdp.py        zero3 through FSDP2 (`apply_fsdp`, FSDPSync)

Expert parallel (ep > 1, ModelParts.experts): BucketSync gives the expert weights a second reducer over the
expert-dp group (mesh.edp), apply_fsdp makes each expert module an FSDP unit over it; both divide by dp x cp,
and every gradient norm counts each expert once (summed over ep, not over its expert-dp copies).

Which one a run gets is decided above this folder (trainer/assemble.py, from the manifest); nothing
here reads a manifest or knows a model.
"""
