"""Trace a model's training step (forward, loss, autograd.grad) into one aten-level fx graph.

`make_fx` over `torch.func.functional_call` records every aten op the step runs, the backward ops
included, in the order they run. While tracing we also record, for every node:
- its phase (placeholder, forward, loss or backward), from where in the trace the model returned and
  the loss was computed;
- the module that issued it (forward), from global module pre/post hooks;
- for backward nodes, the forward node whose autograd node ran it, from autograd pre-hooks matched to
  the forward nodes' ``seq_nr`` (the autograd sequence number make_fx stores in ``node.meta``).

This is the only module that turns model calls into fx graphs; `planner.profiler` turns the graph
into a `solvers.Profile`, and `planner.rewrite` turns its forward part into a checkpointed module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.utils import _pytree as pytree

from planner.capture.record import default_loss, split_inputs, written_positions
from solvers.errors import CkptPlannerError

__all__ = [
    "TraceError",
    "JointTrace",
    "trace_joint",
    "default_loss",
    "split_inputs",
    "written_positions",
]


class TraceError(CkptPlannerError, RuntimeError):
    """The model could not be traced into an aten graph."""


@dataclass
class JointTrace:
    """The joint graph of one training step and what we learned while tracing it."""

    gm: fx.GraphModule
    phase: dict[str, str]
    """Node name -> one of solvers.profile.PHASES (output node excluded)."""
    module: dict[str, str]
    """Node name -> dotted path of the module that issued it; placeholders -> parameter name."""
    grad_of: dict[str, str]
    """Backward node name -> forward node whose autograd node ran it."""
    model_outputs: list[str]
    """Forward nodes that are the model's output leaves (None where a leaf is not a tensor)."""
    out_spec: pytree.TreeSpec
    """Structure of the model's output, to rebuild it from the leaves."""
    out_constants: list[Any]
    """Output leaves that are not tensors (kept as constants), aligned with out_spec's leaves."""
    loss: str
    grads: list[str]
    """Backward nodes holding the parameter gradients."""
    param_names: list[str]
    buffer_names: list[str]
    trainable: list[bool]
    """Per parameter: does it require grad (only those get gradients)."""
    input_spec: pytree.TreeSpec
    """Structure of (args, kwargs), with tensor leaves traced as placeholders."""
    input_constants: list[Any]
    """Non-tensor input leaves, None where the leaf is a tensor."""


def _flatten_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]):
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
    return tensors, constants, spec


def _unflatten_inputs(tensors, constants, spec):
    it = iter(tensors)
    leaves = [next(it) if c is None else c for c in constants]
    return pytree.tree_unflatten(leaves, spec)


def trace_joint(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    params: dict[str, torch.Tensor] | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> JointTrace:
    """Trace forward + loss + autograd.grad into one aten graph.

    `params` and `buffers` replace the model's own tensors while tracing (fake tensors in estimate
    mode, detached aliases and buffer clones in measure mode so that tracing changes nothing the
    user owns). Raises TraceError naming the module and op where tracing fails.
    """
    loss_fn = loss_fn or default_loss
    named_params = dict(model.named_parameters())
    named_buffers = dict(model.named_buffers())
    params = params if params is not None else named_params
    buffers = buffers if buffers is not None else named_buffers
    param_names, buffer_names = list(params), list(buffers)
    trainable = [named_params[n].requires_grad for n in param_names]
    in_tensors, in_constants, in_spec = _flatten_inputs(args, kwargs)
    modname = {id(m): name for name, m in model.named_modules()}

    marks: dict[str, Any] = {"module_events": [], "grad_marks": []}
    stack: list[str] = []

    def graph_len() -> int:
        mode = get_proxy_mode()
        return len(mode.tracer.graph.nodes) if mode is not None else 0

    def pre_hook(mod, _inputs):
        name = modname.get(id(mod))
        if name is not None:
            stack.append(name)
            marks["module_events"].append((graph_len(), stack[-1]))

    def post_hook(mod, _inputs, _output):
        if modname.get(id(mod)) is not None and stack:
            stack.pop()
            marks["module_events"].append((graph_len(), stack[-1] if stack else ""))

    n_p, n_b = len(param_names), len(buffer_names)

    def joint(plist, blist, ilist):
        p = dict(zip(param_names, plist, strict=True))
        p.update(zip(buffer_names, blist, strict=True))
        a, kw = _unflatten_inputs(ilist, in_constants, in_spec)
        h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
        h2 = torch.nn.modules.module.register_module_forward_hook(post_hook)
        try:
            out = torch.func.functional_call(model, p, a, kw)
        finally:
            h1.remove()
            h2.remove()
        marks["fwd_end"] = graph_len()
        loss = loss_fn(out)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TraceError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        if loss.grad_fn is None:
            raise TraceError(
                "the loss does not depend on any trainable parameter (no grad_fn); check that "
                "some parameters have requires_grad=True and that the loss uses the output"
            )
        marks["loss_end"] = graph_len()
        seen: set[int] = set()
        todo = [loss.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))

            def mark(_grad_outputs, fn=fn):
                marks["grad_marks"].append((graph_len(), fn._sequence_nr()))

            fn.register_prehook(mark)
            todo.extend(nf for nf, _ in fn.next_functions)
        wrt = [t for t, tr in zip(plist, trainable, strict=True) if tr]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        out_leaves, out_spec = pytree.tree_flatten(out)
        marks["out_spec"] = out_spec
        marks["out_constants"] = [
            None if isinstance(x, torch.Tensor) else x for x in out_leaves
        ]
        out_tensors = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        marks["n_outputs"] = len(out_tensors)
        grads = [g for g in grads if g is not None]
        marks["n_grads"] = len(grads)
        return loss, grads, out_tensors

    plist = [
        t.detach().requires_grad_(tr) if t.is_floating_point() else t.detach()
        for t, tr in zip(params.values(), trainable, strict=True)
    ]
    blist = list(buffers.values())
    try:
        with fx_traceback.preserve_node_meta():
            gm = make_fx(joint, tracing_mode="real")(plist, blist, in_tensors)
    except CkptPlannerError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with where it happened
        where = stack[-1] if stack else "(outside any module)"
        raise TraceError(
            f"could not trace {type(model).__name__} into an aten graph: in module {where!r}: "
            f"{type(e).__name__}: {e}. Data-dependent control flow and non-torch side effects "
            "cannot be traced; make the branch depend on shapes, or checkpoint that module by hand."
        ) from e

    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != n_p + n_b + len(in_tensors):
        raise TraceError("internal: placeholder count does not match parameters, buffers, inputs")
    phase: dict[str, str] = {}
    module: dict[str, str] = {}
    for i, n in enumerate(placeholders):
        if i < n_p:
            phase[n.name], module[n.name] = "param", param_names[i]
        elif i < n_p + n_b:
            phase[n.name], module[n.name] = "buffer", buffer_names[i - n_p]
        else:
            phase[n.name], module[n.name] = "input", f"input[{i - n_p - n_b}]"

    # Phase and module of each op: graph positions are node counts at the time of the mark.
    events = marks["module_events"]  # chronological: positions never decrease
    ev = 0
    current_module = ""
    grad_marks = marks["grad_marks"]
    gm_i = 0
    current_seq: int | None = None
    seq_owner: dict[int, str] = {}
    prev_seq = None
    grad_seq: dict[str, int] = {}
    for pos, n in enumerate(nodes):
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "get_attr":  # a tensor constant baked into the graph (e.g. a causal mask)
            phase[n.name], module[n.name] = "buffer", f"constant:{n.target}"
            continue
        while ev < len(events) and events[ev][0] <= pos:
            current_module = events[ev][1]
            ev += 1
        while gm_i < len(grad_marks) and grad_marks[gm_i][0] <= pos:
            current_seq = grad_marks[gm_i][1]
            gm_i += 1
        if pos < marks["fwd_end"]:
            phase[n.name] = "forward"
            module[n.name] = current_module
        elif pos < marks["loss_end"]:
            phase[n.name] = "loss"
            module[n.name] = ""
        else:
            phase[n.name] = "backward"
            module[n.name] = ""
            if current_seq is not None:
                grad_seq[n.name] = current_seq
        if phase[n.name] != "backward":
            seq = n.meta.get("seq_nr")
            if seq is not None and seq != prev_seq and seq not in seq_owner:
                seq_owner[seq] = n.name
            prev_seq = seq
    grad_of = {b: seq_owner[s] for b, s in grad_seq.items() if s in seq_owner}

    out_node = next(n for n in nodes if n.op == "output")
    flat_out = list(pytree.tree_leaves(out_node.args[0]))
    loss_node = flat_out[0]
    out_nodes = flat_out[len(flat_out) - marks["n_outputs"]:]
    grad_nodes = flat_out[1 : 1 + marks["n_grads"]]
    return JointTrace(
        gm=gm,
        phase=phase,
        module=module,
        grad_of=grad_of,
        model_outputs=[o.name for o in out_nodes],
        out_spec=marks["out_spec"],
        out_constants=marks["out_constants"],
        loss=loss_node.name,
        grads=[g.name for g in grad_nodes],
        param_names=param_names,
        buffer_names=buffer_names,
        trainable=trainable,
        input_spec=in_spec,
        input_constants=in_constants,
    )


@contextlib.contextmanager
def preserved_rng():
    """Run a block without moving the user's RNG streams (CPU and CUDA)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield
