"""Every private torch API mantra uses, in one place, each with the torch versions it is known to work on.

Private names move between minor releases: torch 2.11 and 2.12 keep the selective-checkpoint cache
as a list per op that recompute pops, 2.13 as an index per op with `_CONSUMED` markers; FSDP2's
state holds one parameter group in 2.11 and a list from 2.12 on. So:

- Importing this module imports no torch, and nothing here looks a private name up until a run
  asks for it: `mantra validate` and `mantra plan` never touch one (tests/test_compat.py counts).
  Every lookup goes through `_private`, which records what it resolved in `RESOLVED`.
- Each API is an entry of `APIS`: the torch versions it is known on (`KNOWN`, the versions CI
  runs) and what happens elsewhere: a public fallback, or `UnsupportedTorch` naming the feature
  and the versions that have it, raised where the feature is first used (never at import).
- Features a manifest can ask for that an installed torch cannot do are refused at validate time
  from the version alone (`missing_features`; trainer/manifest/torch_support.py calls it). Today every
  entry works on every supported version (2.11 to 2.13), so only a torch older than 2.11 is
  refused there; the table is where a newer-only API would say so.

Public APIs are preferred wherever they exist (`dist.reduce_scatter_tensor`, not 2.13's newer
`reduce_scatter_single` alias): those need no entry here, checkpoints included (trainer/checkpoint/
dcp_metadata.py builds only DCP metadata's `__all__` classes, through the public storage interfaces).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Version = tuple[int, int]

OLDEST: Version = (2, 11)  # pyproject's floor; .ci/run's second venv
NEWEST: Version = (2, 13)  # the README's pin
KNOWN = "2.11 to 2.13"


@dataclass(frozen=True)
class Api:
    """A private torch name: the feature that needs it, the versions it is known on, what stands in elsewhere."""

    feature: str
    names: str
    since: Version = OLDEST
    otherwise: str = "the feature raises UnsupportedTorch where it is first used"


APIS = {
    "sac_cache": Api("selective recompute under zero-bubble schedules (zb-h1, zb-h2, zb-v)",
                     "torch.utils.checkpoint: _CachedTorchDispatchMode, and _CONSUMED, _RECOMPUTE, "
                     "_sac_storage_key (2.13) or the per-op list recompute pops (2.11, 2.12)"),
    "checkpoint_wrapper": Api("activation checkpointing (full, selective)",
                              "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper"),
    "stage_backward_input": Api("zero-bubble schedules (the B pass: input gradients only)",
                                "torch.distributed.pipelining._backward.stage_backward_input"),
    "fsdp_internals": Api("zero3 with pp > 1 (one reduce-scatter per stage per step)",
                          "FSDPState._state_ctx.all_states, ._fsdp_param_group (2.11) / ._fsdp_param_groups "
                          "(2.12+), FSDPParamGroup.post_backward, FSDPState._root_post_backward_final_callback"),
    "mesh_flatten": Api("any layout of more than one rank (the flattened dp mesh)", "DeviceMesh._flatten"),
    "mesh_unflatten": Api("expert parallel (the ep and expert-dp meshes carved out of dp x cp)", "DeviceMesh._unflatten"),
    "group_timeouts": Api("every process group bounded by train.hang_timeout_s, the mesh's subgroups included",
                          "torch.distributed.distributed_c10d: _set_pg_timeout, _world.pg_names, and the module's "
                          "default_pg_timeout / default_pg_nccl_timeout that new groups take"),
    "foreach": Api("gradient norms and clipping", "torch._foreach_norm, torch._foreach_mul_",
                   otherwise="a loop of torch.linalg.vector_norm and mul_"),
    "sdpa_ops": Api("selective recompute (which ops to keep)", "torch.ops.aten._scaled_dot_product_*, _grouped_mm",
                    otherwise="the attention ops this torch lacks are left out of the set"),
    "dispatch_modes": Api("MoE experts' one-time grouped-matmul probe inside a recomputed block (models/moe)",
                          "torch.utils._python_dispatch._disable_current_modes"),
    "profiler_events": Api("the CPU live-tensor tracker (bench/, tests/)", "torch._C._profiler._EventType"),
    "grouped_mm": Api("MoE experts as grouped matmuls (models/moe)", "torch._grouped_mm",
                      otherwise="a loop of one SwiGLU per expert (the same result, slower)"),
    "cpu_flash": Api("ring attention's fused CPU blocks (parallel.cp_kind: ring)",
                     "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu and its _backward "
                     "(the same schemas on 2.11 and 2.13)",
                     otherwise="each block as matmuls over query-row chunks (the same result, slower)"),
}

RESOLVED: list[str] = []  # every private name looked up in this process, in order (tests read it)


class UnsupportedTorch(RuntimeError):
    """The installed torch lacks a private API a feature needs; the message names the feature and versions."""


# -- versions, without importing torch ---------------------------------------------------------------

def parse_version(text: str) -> Version:
    """'2.11.0+cu130' -> (2, 11); a dev build's '2.14.0.dev20260101' -> (2, 14)."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if not match:
        raise ValueError(f"not a torch version: {text!r}")
    return int(match.group(1)), int(match.group(2))


@functools.cache
def installed_torch() -> str | None:
    """The installed torch's version string from its metadata (torch is not imported); None if absent.
    Cached: `plan --search` validates thousands of candidate layouts, and the metadata scan is slow."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def format_version(v: Version) -> str:
    return f"{v[0]}.{v[1]}"


def missing_features(features: Sequence[str], version: str | None = None) -> list[str]:
    """For the `APIS` keys a manifest needs: one line per feature this torch cannot do, naming the version it needs."""
    text = version if version is not None else installed_torch()
    if text is None:
        return []  # no torch here (validating on a laptop for a cluster): nothing to say about its version
    have = parse_version(text)
    out = []
    for key in features:
        api = APIS[key]
        if have < api.since:
            out.append(f"{api.feature} needs torch >= {format_version(api.since)} (installed: {text})")
    return out


# -- the lookup every private name goes through -------------------------------------------------------

def _private(key: str, module: str, name: str) -> Any:
    """`module.name`, recorded in RESOLVED; UnsupportedTorch (not ImportError/AttributeError) if it is gone."""
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise _unsupported(key, f"{module}.{name}") from exc
    RESOLVED.append(f"{module}.{name}")
    return value


def _unsupported(key: str, what: str) -> UnsupportedTorch:
    import torch

    api = APIS[key]
    return UnsupportedTorch(f"{api.feature}: this torch ({torch.__version__}) lacks {what}; "
                            f"mantra knows it on torch {KNOWN}")


# -- activation checkpointing -------------------------------------------------------------------------

def checkpoint_wrapper() -> Callable:
    """torch's per-module checkpoint wrapper (non-reentrant); its `_checkpoint_wrapped_module.` prefix is in our FQNs."""
    return _private("checkpoint_wrapper", "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
                    "checkpoint_wrapper")


def _aten_ops(names: tuple[str, ...]) -> set:
    """The default overloads of the aten ops named, those this torch has (names vary by version and backend)."""
    import torch

    packets = [(name, getattr(torch.ops.aten, name, None)) for name in names]
    RESOLVED.extend(f"torch.ops.aten.{name}" for name, packet in packets if packet is not None)
    return {packet.default for _, packet in packets if packet is not None}


def sdpa_ops() -> set:
    """The fused attention ops to keep under selective recompute."""
    return _aten_ops(("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention"))


def grouped_mm_ops() -> set:
    """aten's grouped matmul (the MoE experts' matmuls), if this torch has it: a matmul to selective recompute."""
    return _aten_ops(("_grouped_mm",))


@functools.cache
def cpu_flash_attention() -> tuple[Any, Any] | None:
    """torch's CPU flash-attention (forward, backward) ops, or None if this torch lacks either. Forward
    (q, k, v, dropout_p, is_causal, *, scale) returns (out, row log-sum-exp); backward (dout, q, k, v, out,
    lse, dropout_p, is_causal, *, scale) returns (dq, dk, dv) from the final out and lse, so a ring
    attention block's gradients come out right (trainer/parallel/context/ring.py)."""
    import torch

    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
    ops = tuple(getattr(torch.ops.aten, name, None) for name in names)
    if any(op is None for op in ops):
        return None
    RESOLVED.extend(f"torch.ops.aten.{name}" for name in names)
    return ops


def reusable_selective_contexts(policy: Callable) -> tuple[Any, Any]:
    """(forward, recompute) dispatch modes for selective checkpointing whose recompute can run more than once.

    torch's cache hands each saved output out once; a split backward recomputes a block for B and W.
    2.13 marks entries consumed by index (`_CONSUMED`): put them back after use. 2.11 and 2.12
    pop a list per op: hand the recompute a cursor over the list instead, restarted on each entry.
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    forward, _ = create_selective_checkpoint_contexts(policy)
    module = "torch.utils.checkpoint"
    cached = _private("sac_cache", module, "_CachedTorchDispatchMode")
    if hasattr(importlib.import_module(module), "_CONSUMED"):  # 2.13+
        marks = (_private("sac_cache", module, "_CONSUMED"), _private("sac_cache", module, "_RECOMPUTE"))
        key_of = _private("sac_cache", module, "_sac_storage_key")
        ignored = _private("sac_cache", module, "SAC_IGNORED_OPS")
        return forward, _indexed_reusable(cached, marks, key_of, ignored)(None, forward.storage)
    return forward, _listed_reusable(cached)(policy, forward.storage, False)


def _indexed_reusable(cached: type, marks: tuple, key_of: Callable, ignored: Any) -> type:
    class Reusable(cached):
        """2.13's recompute mode, except that an entry stays in the cache after use."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            key = key_of(func, args) if func not in ignored else None
            entries = self.storage.get(key) if key is not None else None
            index = self.func_counter[key] if key is not None else None
            entry = entries.get(index) if entries is not None else None
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if entry is not None and entry not in marks:
                entries[index] = entry  # put back what the parent marked consumed
            return out

    return Reusable


class _Cursor:
    """A read-only view of one op's saved outputs that `pop(0)` walks instead of emptying (2.11, 2.12)."""

    def __init__(self, items: list) -> None:
        self.items, self.at = items, 0

    def __len__(self) -> int:
        return len(self.items) - self.at

    def pop(self, index: int) -> Any:
        assert index == 0, index
        self.at += 1
        return self.items[self.at - 1]


class _Cursors:
    """The storage a recompute sees: one fresh cursor per op over the forward's lists."""

    def __init__(self, storage: dict) -> None:
        self.storage, self.cursors = storage, {}

    def get(self, func: Any) -> _Cursor | None:
        if func not in self.storage:
            return None
        return self.cursors.setdefault(func, _Cursor(self.storage[func]))


def _listed_reusable(cached: type) -> type:
    class Reusable(cached):
        """2.11/2.12's recompute mode over cursors, restarted each time a recompute begins."""

        def __init__(self, policy_fn, storage, allow_cache_entry_mutation) -> None:
            super().__init__(policy_fn, _Cursors(storage), allow_cache_entry_mutation)
            self.saved = storage

        def __enter__(self):
            self.storage = _Cursors(self.saved)
            getattr(self.policy_fn, "restart", lambda: None)()  # a counting policy starts its recompute count
            return super().__enter__()

    return Reusable


# -- pipelining -----------------------------------------------------------------------------------------

def stage_backward_input() -> Callable:
    """torch.distributed.pipelining's B pass: input gradients, and the intermediates W will need."""
    return _private("stage_backward_input", "torch.distributed.pipelining._backward", "stage_backward_input")


# -- FSDP2 ----------------------------------------------------------------------------------------------

def fsdp_finish_backward(state: Any) -> None:
    """Run every unit's post-backward (reduce-scatter, reshard) under root `state`, then the root's final
    callback, which orders the reduce-scatters before later use (GPU streams). As torch.distributed.pipelining does."""
    try:
        units = state._state_ctx.all_states
        final = state._root_post_backward_final_callback
    except AttributeError as exc:
        raise _unsupported("fsdp_internals", f"FSDPState.{exc.name}") from exc
    RESOLVED.append("FSDPState._state_ctx.all_states")
    for unit in units:
        for group in _param_groups(unit):
            group.post_backward()
    final()


def _param_groups(unit: Any) -> list:
    if hasattr(unit, "_fsdp_param_groups"):  # 2.12+: a list
        return list(unit._fsdp_param_groups)
    if hasattr(unit, "_fsdp_param_group"):  # 2.11: one group or None
        return [unit._fsdp_param_group] if unit._fsdp_param_group is not None else []
    raise _unsupported("fsdp_internals", "FSDPState._fsdp_param_groups")


# -- device mesh ------------------------------------------------------------------------------------------

def flatten_mesh(mesh: Any, name: str) -> Any:
    """One mesh dimension over several (dp = dp_replicate × dp_shard); DeviceMesh has no public flatten."""
    flatten = getattr(mesh, "_flatten", None)
    if flatten is None:
        raise _unsupported("mesh_flatten", "DeviceMesh._flatten")
    RESOLVED.append("DeviceMesh._flatten")
    return flatten(mesh_dim_name=name)


def unflatten_mesh(mesh: Any, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A 1-D mesh split into len(sizes) dimensions (dp x cp -> edp x ep), outermost first; the result shares
    the root mesh, so FSDP2 can concatenate its dimensions with a DTensor's (experts sharded over ep)."""
    unflatten = getattr(mesh, "_unflatten", None)
    if unflatten is None:
        raise _unsupported("mesh_unflatten", "DeviceMesh._unflatten")
    RESOLVED.append("DeviceMesh._unflatten")
    return unflatten(0, tuple(sizes), tuple(names))


# -- process-group timeouts -------------------------------------------------------------------------------

def bound_groups(timeout: Any) -> int:
    """Every process group this rank belongs to, and every group created from now on (torch's `new_group`
    takes the module's default, not the world group's: 30 minutes on gloo, 10 on NCCL), gets `timeout`
    (a timedelta). Returns how many existing groups were bounded."""
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    set_timeout = _private("group_timeouts", "torch.distributed.distributed_c10d", "_set_pg_timeout")
    world = _private("group_timeouts", "torch.distributed.distributed_c10d", "_world")
    c10d.default_pg_timeout = timeout
    if getattr(c10d, "default_pg_nccl_timeout", None) is not None:
        c10d.default_pg_nccl_timeout = timeout
    bounded = 0
    for group in list(world.pg_names):
        with contextlib.suppress(ValueError, RuntimeError):  # a group this rank is not in, or one torch closed
            set_timeout(timeout, group)
            bounded += 1
    return bounded


# -- foreach kernels --------------------------------------------------------------------------------------

def foreach_norm(tensors: Sequence) -> list:
    """The 2-norm of each tensor, in one fused kernel where torch has it."""
    import torch

    fused = getattr(torch, "_foreach_norm", None)
    if fused is None:
        return [torch.linalg.vector_norm(t) for t in tensors]
    RESOLVED.append("torch._foreach_norm")
    return fused(tensors)


def foreach_mul_(tensors: Sequence, scalar: Any) -> None:
    """Multiply each tensor in place by `scalar` (a number or a 0-d tensor)."""
    import torch

    fused = getattr(torch, "_foreach_mul_", None)
    if fused is None:
        for t in tensors:
            t.mul_(scalar)
        return
    RESOLVED.append("torch._foreach_mul_")
    fused(tensors, scalar)


# -- grouped matmul --------------------------------------------------------------------------------------

def grouped_mm() -> Callable | None:
    """torch._grouped_mm (rows of a 2-D input grouped by `offs`, times a stack of matrices), or None
    where this torch lacks it: the MoE experts then loop over experts."""
    import torch

    fused = getattr(torch, "_grouped_mm", None)
    if fused is not None:
        RESOLVED.append("torch._grouped_mm")
    return fused


@contextlib.contextmanager
def invisible_to_recompute():
    """Run a side computation (a one-time probe) inside a forward so that activation checkpointing never
    sees it: no dispatch mode (selective recompute's cache) records its ops, no saved-tensor hook (the
    checkpoint's) packs its tensors, no autocast changes its dtypes. Its own autograd works as usual."""
    import torch

    disable_modes = _private("dispatch_modes", "torch.utils._python_dispatch", "_disable_current_modes")
    with disable_modes(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
            torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        yield


# -- profiler -----------------------------------------------------------------------------------------------

def profiler_event_type() -> Any:
    """The profiler event-tree node kinds (`.Allocation`), for the CPU live-tensor tracker."""
    return _private("profiler_events", "torch._C._profiler", "_EventType")
