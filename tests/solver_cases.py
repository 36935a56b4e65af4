"""Tiny hand-built profiles for the solver tests (no torch): chains and small DAGs.

`build(ops)` makes a Profile from a compact description: forward op k writes one new storage of
`out_bytes` in `time_ms`, reads the outputs of `inputs` (default: the op before it, or the model
input for op 0) and saves what it reads; the loss sums the last op; the mirrored backward runs one
op per forward op (reverse order) that reads the gradient of its output and what its forward op
saved, and writes one gradient per input it read.
"""

from __future__ import annotations

from dataclasses import dataclass

from solvers import Node, Profile

MIB = 2**20


@dataclass(frozen=True)
class Op:
    out_bytes: int
    time_ms: float = 1.0
    inputs: tuple[int, ...] | None = None
    """Forward ops read (indices; -1 = the model input); None: the previous op."""
    module: str = ""


def build(ops: list[Op], input_bytes: int = MIB, param_bytes: int = 1024) -> Profile:
    storage: list[int] = [param_bytes, input_bytes]
    nodes = [
        Node(name="w", op="placeholder", phase="param", storage=0, new_storages=(0,)),
        Node(name="x", op="placeholder", phase="input", storage=1, new_storages=(1,)),
    ]
    out_of = {-1: 1}
    name_of = {-1: "x"}
    ins_of: dict[int, tuple[int, ...]] = {}
    for k, op in enumerate(ops):
        ins = op.inputs if op.inputs is not None else (k - 1,)
        ins_of[k] = ins
        s = len(storage)
        storage.append(op.out_bytes)
        out_of[k], name_of[k] = s, f"f{k}"
        nodes.append(Node(
            name=f"f{k}", op="aten.mm.default" if k % 2 == 0 else "aten.relu.default",
            phase="forward", inputs=tuple(name_of[i] for i in ins) + ("w",), module=op.module,
            storage=s, new_storages=(s,), saves=tuple(sorted({out_of[i] for i in ins})),
            time_ms=op.time_ms,
        ))
    last = len(ops) - 1
    storage.append(4)
    nodes.append(Node(name="loss", op="aten.sum.default", phase="loss", inputs=(f"f{last}",),
                      storage=len(storage) - 1, new_storages=(len(storage) - 1,), time_ms=0.1))
    storage.append(4)
    grad = {last: [len(storage) - 1]}
    seed = Node(name="g_loss", op="aten.ones_like.default", phase="backward", inputs=("loss",),
                storage=len(storage) - 1, new_storages=(len(storage) - 1,))
    nodes.append(seed)
    grad_name = {len(storage) - 1: "g_loss"}
    for k in range(last, -1, -1):
        reads = [grad_name[s] for s in grad.get(k, [])] + [name_of[i] for i in ins_of[k]]
        outs = []
        for i in ins_of[k]:
            if i >= 0:
                storage.append(ops[i].out_bytes)
                outs.append(len(storage) - 1)
                grad.setdefault(i, []).append(len(storage) - 1)
        nm = f"b{k}"
        for s in outs:
            grad_name[s] = nm
        nodes.append(Node(
            name=nm, op="aten.mm.default", phase="backward", inputs=tuple(dict.fromkeys(reads)),
            storage=outs[0] if len(outs) == 1 else None, new_storages=tuple(outs),
            grad_of=f"f{k}", time_ms=2 * ops[k].time_ms,
        ))
    return Profile(nodes=tuple(nodes), storage_bytes=tuple(storage), loss="loss")


def chain(sizes_mib: list[float], times: list[float] | None = None, per_block: int = 0) -> Profile:
    times = times or [1.0] * len(sizes_mib)
    return build([
        Op(int(b * MIB), t, module=f"layers.{k // per_block}" if per_block else "")
        for k, (b, t) in enumerate(zip(sizes_mib, times))
    ])


def chain4() -> Profile:
    """A 4-node chain of 4 MiB activations, 1 ms each."""
    return chain([4, 4, 4, 4], [1, 1, 1, 1])


def diamond() -> Profile:
    """x -> f0 -> (f1, f2) -> f3 (f3 reads both branches) -> f4."""
    return build([Op(4 * MIB), Op(8 * MIB, 2.0), Op(8 * MIB, 2.0, inputs=(0,)),
                  Op(4 * MIB, inputs=(1, 2)), Op(4 * MIB)])


def residual() -> Profile:
    """Two residual blocks: h = f(x) + x, with the block's ops in module layers.i."""
    ops = []
    for b in range(2):
        base = len(ops) - 1
        ops += [Op(4 * MIB, module=f"layers.{b}"), Op(8 * MIB, module=f"layers.{b}"),
                Op(4 * MIB, module=f"layers.{b}"),
                Op(4 * MIB, module=f"layers.{b}", inputs=(len(ops) + 2, base))]
    return build(ops)


def sqrt_n_trap() -> Profile:
    """Eight blocks of two ops; block 5 is slow (50 ms per op) but small (1 MiB against 4 MiB):
    equal segments over the blocks replay it, while keeping it costs almost no memory."""
    ops = []
    for b in range(8):
        size, ms = (MIB, 50.0) if b == 5 else (4 * MIB, 1.0)
        ops += [Op(size, ms, module=f"layers.{b}"), Op(size, ms, module=f"layers.{b}")]
    return build(ops)


CASES = {"chain4": chain4, "diamond": diamond, "residual": residual, "sqrt_n_trap": sqrt_n_trap}
