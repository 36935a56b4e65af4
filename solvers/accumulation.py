"""The step of a micro-batch under gradient accumulation: every gradient is already held.

A profile records a step that starts with no parameter gradients (``zero_grad(set_to_none=True)``,
the default, before it): backward allocates each gradient and autograd's `AccumulateGrad` keeps
that tensor as ``param.grad``, so a parameter's gradient exists only from its own backward on.
Under gradient accumulation every micro-batch after the first starts with all of them held from
the micro-batches before (so does every step of a loop that zeroes gradients with
``set_to_none=False``), and `AccumulateGrad` adds each new gradient into the held one in place,
after which the new tensor is freed (torch 2.13, `torch/csrc/autograd/functions/accumulate_grad.h`:
``variable_grad += new_grad`` when the gradient is defined and grad mode is off, as it is in
``backward()``). Such a step peaks higher than the first one: by the gradients of every
parameter whose backward has not yet run at the first step's peak, often all of them but the
last layers'.

`holding_grads` writes that step into the profile: the gradients become fixed memory (held
before the step, as parameters are), and what backward makes for them is freed as soon as it is
added. The simulator, and with it every solver, then prices that step; a plan made on it holds
for the first micro-batch too, which peaks no higher.

Under DDP the held gradients are the same full gradients beside DDP's buckets (a micro-batch
under ``no_sync()`` is the single process's step; the one that synchronizes copies each gradient
into its bucket and back, allocating nothing), so the transform applies before or after
`solvers.distributed.per_rank`'s.

Under FSDP2 it applies after `per_rank` (to one rank's profile): FSDP2 reduce-scatters every
micro-batch's gradients (its default: gradient sync on) and adds each unit's new sharded
gradient into the one held (torch 2.13, `_fsdp_collectives.foreach_reduce`:
``sharded_param.grad._local_tensor += new_sharded_grad``), so a later micro-batch holds the
sharded gradients from its start and each new shard dies once added. With gradient sync turned
off between micro-batches (``set_requires_gradient_sync(False)``) FSDP2 keeps the unsharded
gradients instead: not modelled.
"""

from __future__ import annotations

import dataclasses

from solvers.errors import ProfileError
from solvers.profile import FIXED_PHASES, Node, Profile

__all__ = ["holding_grads", "refuse_fsdp"]

_SHARD_FIRST = (
    "under FSDP2, apply gradient accumulation to one rank's profile: per_rank first (sharding "
    "the gradients), then holding_grads")

HELD_GRADS = "accumulation.held_gradients"
"""Name of the node that holds the gradients from before the step."""


def holding_grads(profile: Profile) -> Profile:
    """`profile`'s step as a micro-batch after the first under gradient accumulation: every
    trainable parameter's gradient (``grad_bytes``) held from the start as fixed memory, and the
    gradients backward makes freed once added into them (no longer kept to the step's end)."""
    if profile.meta.grads_held:
        raise ProfileError("this profile already describes a step with its gradients held "
                           "(gradient accumulation); start from the profile as recorded")
    if profile.meta.sharding == "fsdp":
        return _fsdp_holding(profile)
    p = profile
    # What backward made for the parameters: the recording saw it held to the step's end (as
    # `.grad`, released at the last node); here it dies once added into the held gradient.
    by_name = {n.name: n for n in p.nodes}
    made = {s for name in p.grads for s in (*by_name[name].new_storages, by_name[name].storage)
            if s is not None}
    nodes = [dataclasses.replace(n, releases=tuple(s for s in n.releases if s not in made))
             if made.intersection(n.releases) else n for n in p.nodes]
    return _with_held(p, nodes)


def _fsdp_holding(p: Profile) -> Profile:
    """One FSDP2 rank's step with the sharded gradients held from its start: each unit's new
    sharded gradient (`per_rank`'s ``fsdp.sharded_grads``) is added into the held one and dies."""
    shards = set(p.grads)
    nodes: list[Node] = []
    for n in p.nodes:
        nodes.append(n)
        if n.name in shards:
            tag = n.name[n.name.index("("):]
            nodes.append(Node(name=f"fsdp.accumulate{tag}", op="fsdp.accumulate",
                              phase="backward", releases=n.new_storages))
    return _with_held(p, nodes)


def _with_held(p: Profile, nodes: list[Node]) -> Profile:
    """`p` with `nodes`, and its gradients (``grad_bytes``) held as fixed memory before the
    step; what backward makes for a parameter no longer counts as its gradient (`grads`): it
    dies once added into the held one."""
    sid = len(p.storage_bytes)
    first = next((i for i, n in enumerate(nodes) if n.phase not in FIXED_PHASES), len(nodes))
    held = Node(name=HELD_GRADS, op="placeholder", phase="buffer", storage=sid,
                new_storages=(sid,))
    return dataclasses.replace(
        p, nodes=(*nodes[:first], held, *nodes[first:]),
        storage_bytes=(*p.storage_bytes, p.grad_bytes),
        grads=(),
        meta=dataclasses.replace(p.meta, grads_held=True),
    )


def refuse_fsdp(profile: Profile) -> None:
    """Raise where `profile` holds gradients (FSDP2 with accumulation is not modelled)."""
    if profile.meta.grads_held:
        raise ProfileError(_SHARD_FIRST)
