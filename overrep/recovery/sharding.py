"""Sharded recovery training (``recovery.shard: fsdp``): torch's FSDP2 (``fully_shard``) over the ranks.

Without it every rank holds all of the recovery modules' parameters, gradients and AdamW state
and one all-reduce averages the gradients (:mod:`overrep.distributed`). With it each recovery
block (a decoder layer of the pruned model, with its W, D and norm wrappers) and a final norm
that a module owns become one ``fully_shard`` unit under the recovery module as root: every rank
keeps 1/N of their parameters (dim 0), gradients and AdamW state, gathers a block's full
parameters only for its forward and backward, and FSDP reduce-scatters the gradients (the mean
over the ranks, in fp32). The rest of the pruned model is frozen and stays whole on every rank.

* **Precision.** ``recovery.precision: bf16`` stays autocast's (:mod:`overrep.core.precision`):
  FSDP gathers the fp32 masters and does not cast them (no ``param_dtype``), because D is applied
  as ``I + (D - I)`` with ``D - I`` formed in fp32 (:mod:`overrep.core.projection`); bf16 copies
  of D would round its small updates away. The fold at merge time reads the gathered fp32 masters.
* **Checkpoints** keep the one full-tensor format: every rank takes part in gathering the
  parameters and the AdamW state, rank 0 writes; on resume every rank keeps its own shard of what
  it read. A sharded run resumes unsharded and the other way round.
* **Merge.** :func:`gather` (every rank, after training) gives each block its full parameters
  back as plain tensors and takes FSDP off, so rank 0 merges, evaluates and exports as usual.
* Anything that runs a sharded block (the validation loss and perplexity, too) must run on every
  rank, since a block's forward gathers its parameters from all of them.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..distributed import World
from ..errors import OverRepError

log = logging.getLogger(__name__)

SHARDS = ("none", "fsdp")


def check_shard(value: str, where: str = "recovery.shard") -> str:
    if value not in SHARDS:
        raise OverRepError(f"{where} must be one of {', '.join(SHARDS)}, got {value!r}")
    return value


def _dtensor():
    if not torch.distributed.is_available():
        return ()  # isinstance(x, ()) is False: nothing is sharded in a build without torch.distributed
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(tensors) -> bool:
    DTensor = _dtensor()
    return any(isinstance(t, DTensor) for t in tensors)


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain full copy of ``t`` (a sharded tensor is gathered: every rank must call)."""
    if isinstance(t, _dtensor()):
        return t.full_tensor().detach()
    return t.detach().clone()


def like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The full tensor ``t`` laid out like ``p``: this rank's shard of it when ``p`` is sharded
    (every rank holds all of ``t``: no communication)."""
    if not isinstance(p, _dtensor()):
        return t
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)


def host_copy(p: torch.Tensor) -> torch.Tensor:
    """A CPU copy of this rank's part of ``p`` (its shard when ``p`` is sharded): kept off the
    accelerator, so a copy of the trainable weights (``recovery.keep_best``) costs host memory,
    not device memory."""
    local = p.to_local() if isinstance(p, _dtensor()) else p
    return local.detach().to("cpu", copy=True)


def full_from_host(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The full tensor whose :func:`host_copy` for ``p`` is ``t`` (a sharded ``p``: every rank must call)."""
    if not isinstance(p, _dtensor()):
        return t
    DTensor = _dtensor()
    return DTensor.from_local(t.to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride()).full_tensor().detach().cpu()


@torch.no_grad()
def copy_from_host(p: torch.Tensor, t: torch.Tensor) -> None:
    """Write a :func:`host_copy` ``t`` back into ``p`` (into this rank's shard when sharded)."""
    (p.to_local() if isinstance(p, _dtensor()) else p).copy_(t)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor (a norm of sharded gradients comes back replicated)."""
    return t.full_tensor() if isinstance(t, _dtensor()) else t


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]  # the order state_dict() numbers them in


def optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """``opt.state_dict()`` with full tensors in place of sharded ones (every rank must call)."""
    state = opt.state_dict()
    state["state"] = {i: {k: full(v) if isinstance(v, _dtensor()) else v for k, v in s.items()}
                      for i, s in state["state"].items()}
    return state


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict) -> None:
    """Load a full-tensor optimiser state; each rank keeps its shard of a sharded parameter's."""
    params = _params(opt)
    per = {}
    for i, s in state["state"].items():
        p = params[i] if isinstance(i, int) and i < len(params) else None
        per[i] = {k: like(v, p) if p is not None and torch.is_tensor(v) and v.shape == p.shape else v
                  for k, v in s.items()}
    opt.load_state_dict({**state, "state": per})


def shard_objective(objective, world: World) -> bool:
    """Shard ``objective``'s recovery modules over ``world`` (in place; before the optimiser is
    made). Returns whether it did: one process has nothing to shard over."""
    modules = getattr(objective, "modules", None)
    if modules is None:
        raise OverRepError("recovery.shard: fsdp shards layer-wise recovery modules; this method trains the "
                           "whole model (use recovery.shard: none, which averages gradients over the ranks)")
    if not world.distributed:
        log.info("recovery.shard: fsdp with one process: nothing to shard over, training unsharded")
        return False
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if any(isinstance(m, FSDPModule) for m in modules):
        return True
    device = next(p for m in modules for p in m.parameters()).device
    mesh = init_device_mesh(device.type, (world.size,))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)  # no param_dtype: see the module's docstring
    for m in modules:
        units = list(m.blocks) + ([m.norm] if m.norm is not None and list(m.norm.parameters()) else [])
        for unit in units:  # each its own unit: the pruned model also calls them directly (perplexity)
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
        fully_shard(m, mesh=mesh, mp_policy=policy)
    return True


@torch.no_grad()
def gather(objective) -> None:
    """Undo :func:`shard_objective` (every rank, collectively): full plain parameters in every
    block again and no FSDP hooks, so that the modules merge and the model runs on one rank."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed.fsdp import FSDPModule

    roots = [m for m in getattr(objective, "modules", ()) if isinstance(m, FSDPModule)]
    DTensor = _dtensor()
    for root in roots:
        units = [m for m in root.modules() if isinstance(m, FSDPModule)]
        for u in units:
            u.reshard()  # every parameter back to its sharded DTensor
        for m in root.modules():  # the same order on every rank: the gathers pair up
            for name, p in list(m._parameters.items()):
                if isinstance(p, DTensor):
                    setattr(m, name, nn.Parameter(p.full_tensor().detach(), requires_grad=p.requires_grad))
        for u in units:
            state = u._get_fsdp_state()
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            u.__class__ = type(u).__mro__[FSDPModule._orig_cls_mro_index]
            for key in (STATE_KEY, REGISTRY_KEY):
                u.__dict__.pop(key, None)
        for m in root.modules():
            for key in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
                m.__dict__.pop(key, None)
    if roots and is_sharded(p for m in objective.modules for p in m.parameters()):
        raise OverRepError("recovery.shard: fsdp: parameters are still sharded after gathering (a torch "
                           "version this code does not know?)")
