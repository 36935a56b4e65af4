"""Estimate mode: record a step with fake tensors for a device one does not have.

The model's own code runs on `FakeTensorMode` tensors (shapes, dtypes and aliasing, no data and no
memory), so a 70B model profiles on a laptop. What cannot run is code that reads tensor values
(`.item()`, a branch on `x.sum() > 0`): the recorder names the module where that happens.

Times come from a roofline (`planner.devices`). Two kernels differ between a CPU and a GPU in what
they keep for backward, and are routed here to what the GPU runs:
- dropout: CUDA and ROCm run ``native_dropout``, which keeps a bool mask (1 byte per element),
  where the CPU decomposes dropout into ``bernoulli_`` with a mask of the input's dtype;
- SDPA with dropout: CUDA's flash and memory-efficient kernels apply dropout inside the kernel and
  keep only the output and log-sum-exp (grouped-query attention included, with the keys and
  values unexpanded), where a CPU tensor takes the math path, which keeps the (seq x seq)
  probabilities. Not where the mask is trained (a relative position bias, as Swin
  adds): the CPU's flash kernel takes no gradient for it, so that call keeps the math path (a
  GPU's memory-efficient kernel also returns a mask gradient of the same (seq x seq) size).

Fake tensors have no values, but the integer inputs of a step (token ids, attention masks,
position ids) and the small tensors computed from them alone (``arange`` positions, a mask turned
to bool) have the values a real step would have. `Shadows` keeps a real copy of those, so that
code reading them (transformers asks whether a mask has padding, or whether position ids hold
packed sequences, to decide whether to build a (seq x seq) mask at all) takes the branch the
real step takes, not the conservative one it takes on a tensor it cannot read.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from planner.capture.record import storage_of, written_positions
from planner.devices import DeviceSpec, roofline_ms

__all__ = ["Faker", "Shadows", "gpu_kernels", "roofline_times", "transformers_values"]

aten = torch.ops.aten


class Faker:
    """Real or meta tensors -> fake tensors of the same shape, dtype and requires_grad; with
    `shadows`, a real tensor given with ``shadow=True`` (the example inputs and the buffers, not
    the parameters) is its fake's shadow (its values)."""

    def __init__(self, mode: FakeTensorMode, shadows: Shadows | None = None):
        self.mode = mode
        self.shadows = shadows
        self._done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, t: torch.Tensor, shadow: bool = False) -> torch.Tensor:
        """The fake of `t`; the same tensor given twice (labels = input_ids) gets one fake."""
        hit = self._done.get(id(t))
        if hit is not None and hit[0] is t:
            f = hit[1]
        else:
            f = self._fake(t)
            self._done[id(t)] = (t, f)
        if shadow and self.shadows is not None and t.device.type != "meta":
            self.shadows.add(f, t.detach().clone())  # a copy: no op of the step writes t
        return f

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            with self.mode:
                f = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        else:
            f = self.mode.from_tensor(t)
        if t.requires_grad and (t.is_floating_point() or t.is_complex()):
            f = f.detach().requires_grad_(True)
        return f


class Shadows(TorchDispatchMode):
    """Real values beside the fakes of a step, for the tensors whose values the step can know.

    A fake gets a shadow when it is made from a real tensor (`Faker`: the example inputs and the
    model's buffers) or when an op computes it from shadowed tensors alone (or from none: a
    deterministic factory such as ``arange``); parameters, and everything they touch, have
    none. The op is run again on the shadows, outside fake mode, so the shadow holds what a real
    step would hold. Reading a shadowed fake's value (``.item()``, ``bool()``, ``nonzero``)
    returns the shadow's; reading any other fake's value still fails as fake tensors do.
    Shadows are kept only for outputs of at most `limit` elements (masks and ids, not
    activations), and a shadowed tensor written by an op from unknown values loses its shadow.

    Enter it inside the fake mode (so that it sees each op before the fake kernels do), and
    `transformers_values()` while it is active.
    """

    limit = 1 << 22

    def __init__(self, fake_mode: FakeTensorMode):
        super().__init__()
        self.fake_mode = fake_mode
        # id(fake) -> (weak reference to the fake, real). Weak: a second strong reference to an
        # op's output makes autograd hand the model a detached copy (an extra `detach` op).
        self._real: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._on_storage: dict[int, set[int]] = {}  # storage key -> ids of shadowed fakes on it
        self._constants: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # real -> its copy
        self._writes: dict[Any, list[tuple[int, str]]] = {}

    def add(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        if real.numel() > self.limit:
            return
        key, where = id(fake), _storage_key(fake)

        def forget(ref: weakref.ref, key: int = key, where: int = where) -> None:
            if self._real.get(key, (None,))[0] is ref:
                del self._real[key]
                self._on_storage.get(where, set()).discard(key)

        self._real[key] = (weakref.ref(fake, forget), real)
        self._on_storage.setdefault(where, set()).add(key)

    def real_of(self, t: Any) -> torch.Tensor | None:
        """The shadow of fake `t`, None if it has none. A real tensor (a constant the model's
        code made, ``torch.tensor(...)``, or cached before the step) has its values: a copy of
        it, made once, so that no re-run op aliases or writes the model's own tensor."""
        if not isinstance(t, FakeTensor):
            if t.device.type == "meta" or t.numel() > self.limit:
                return None
            hit = self._constants.get(id(t))
            if hit is None or hit[0]() is not t:
                with unset_fake_temporarily():  # read inside the step: a real copy, not a fake
                    hit = (weakref.ref(t), t.detach().clone())
                self._constants[id(t)] = hit
            return hit[1]
        hit = self._real.get(id(t))
        if hit is None or hit[0]() is not t:
            return None
        return hit[1]

    def _forget_storage(self, t: torch.Tensor) -> None:
        """`t` was written from values no shadow has: every view of its storage loses its shadow."""
        for key in self._on_storage.pop(_storage_key(t), ()):
            self._real.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, tree = pytree.tree_flatten((args, kwargs))
        reals = [self.real_of(x) if isinstance(x, torch.Tensor) else x for x in flat]
        known = all(r is not None for r, x in zip(reals, flat, strict=True)
                    if isinstance(x, torch.Tensor)) and _deterministic(func)
        written = self._written(func)
        if known and any(not isinstance(t, FakeTensor) for t in _args_at(written, args, kwargs)):
            known = False  # never write a real tensor of the user's (a cached constant)
        if known and func is torch.ops.aten._local_scalar_dense.default:
            ok, value = self._run_real(func, reals, tree)
            if ok:
                return value
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            if known:
                ok, real_out = self._run_real(func, reals, tree)
                if ok:
                    out = pytree.tree_map_only(torch.Tensor, self.fake_mode.from_tensor, real_out)
                    self._pair(out, real_out)
                    return out
            elif func in _SHAPE_FROM and all(
                    self.real_of(t) is not None
                    for t in _args_at([(i, "") for i in _SHAPE_FROM[func]], args, {})):
                # the output's shape follows from known arguments (a mask, CTC targets and
                # lengths): the op on stand-ins for the others gives it; no values are known
                ok, real_out = self._run_real(func, [_stand_in(r, x) for r, x in
                                                     zip(reals, flat, strict=True)], tree)
                if ok:
                    return pytree.tree_map_only(torch.Tensor, self.fake_mode.from_tensor,
                                                real_out)
            raise
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        small = bool(outs) and all(o.numel() <= self.limit for o in outs)
        ok = False
        if known and (small or written):  # an in-place write keeps its target's shadow true
            ok, real_out = self._run_real(func, reals, tree)
            if ok:
                self._pair(out, real_out)
        if not ok:
            for target in _args_at(written, args, kwargs):
                self._forget_storage(target)
        return out

    def _run_real(self, func, reals: list[Any], tree) -> tuple[bool, Any]:
        """`func` on the shadows, outside fake mode: (True, its result), or (False, None) where
        it cannot run there (e.g. shadows on two devices); the outputs then have no shadow."""
        r_args, r_kwargs = pytree.tree_unflatten(reals, tree)
        try:
            with unset_fake_temporarily():
                return True, func(*r_args, **r_kwargs)
        except Exception:  # noqa: BLE001 - without a shadow the fake is what it was: no values
            return False, None

    def _pair(self, out: Any, real_out: Any) -> None:
        for f, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(real_out), strict=False):
            if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor):
                self.add(f, r)

    def _written(self, func) -> list[tuple[int, str]]:
        """Position and name of each argument `func` writes (in place, or ``out=``)."""
        hit = self._writes.get(func)
        if hit is None:
            names = [a.name for a in func._schema.arguments]
            hit = [(i, names[i]) for i in written_positions(func)]
            self._writes[func] = hit
        return hit


_SHAPE_FROM = {
    torch.ops.aten.index.Tensor: (1,),  # x[mask]: as many rows as the mask has True
    torch.ops.aten.masked_select.default: (1,),
    torch.ops.aten._ctc_loss.default: (1, 2, 3),  # targets, input and target lengths
    torch.ops.aten._ctc_loss.Tensor: (1, 2, 3),
}
"""Ops whose output shape depends on the values of these arguments only."""


def _args_at(positions: list[tuple[int, str]], args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors at these (position, name) arguments, lists of tensors included."""
    found = []
    for i, name in positions:
        a = args[i] if i < len(args) else kwargs.get(name)
        found += [t for t in pytree.tree_leaves(a) if isinstance(t, torch.Tensor)]
    return found


def _stand_in(real: Any, fake: Any) -> Any:
    """`real`, or for a tensor without one, zeros of its shape and dtype that take no memory."""
    if real is not None or not isinstance(fake, torch.Tensor):
        return real
    with unset_fake_temporarily():
        return torch.zeros((), dtype=fake.dtype).expand(fake.shape)


def _storage_key(t: torch.Tensor) -> int:
    try:
        return storage_of(t)._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


def _deterministic(func) -> bool:
    """Whether `func`'s output is a function of its arguments: not a random draw, not the
    unwritten memory of an ``empty``."""
    if torch.Tag.nondeterministic_seeded in func.tags:
        return False
    return not func.__name__.split(".")[0].lstrip("_").startswith(("empty", "new_empty"))


@contextlib.contextmanager
def transformers_values(shadows: Shadows) -> Iterator[None]:
    """Let transformers read the shadowed fakes: its `is_tracing` counts every fake tensor as
    traced (no values) and then builds the full (seq x seq) mask that a real step skips."""
    mod = sys.modules.get("transformers.utils.import_utils")
    original = getattr(mod, "is_fake_tensor", None)
    if original is None:
        yield
        return

    def is_fake_tensor(x) -> bool:
        return original(x) and shadows.real_of(x) is None

    mod.is_fake_tensor = is_fake_tensor
    try:
        yield
    finally:
        mod.is_fake_tensor = original


@contextlib.contextmanager
def gpu_kernels() -> Iterator[None]:
    """Route dropout and SDPA-with-dropout to the kernels a GPU runs (see the module docstring)."""
    sdpa = F.scaled_dot_product_attention
    dropout = F.dropout

    def gpu_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        # GQA (fewer key/value heads) too: a GPU's fused kernels take it natively, and the fake
        # kernel takes the unexpanded keys and values (gradients shaped like them)
        gqa_ok = not enable_gqa or isinstance(query, FakeTensor)
        if (dropout_p > 0 and gqa_ok and query.dim() == 4 and key.shape == value.shape
                and (attn_mask is None or not attn_mask.requires_grad)):
            out, _lse = aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )
            return out
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    def gpu_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
                    inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0 or inplace:
            return dropout(input, p, training, inplace)
        out, _mask = torch.native_dropout(input, p, True)
        return out

    F.scaled_dot_product_attention = gpu_sdpa
    F.dropout = gpu_dropout
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
        F.dropout = dropout


def roofline_times(ops: list[Any], spec: DeviceSpec, dtype: str) -> None:
    """Set every recorded op's time to its roofline estimate on `spec`, at the dtype the op
    computes in (a bf16 matmul under autocast at the bf16 peak), `dtype` where it has none
    (placeholders, getitem and views, which only relabel memory: 0)."""
    for r in ops:
        if r.phase in ("param", "buffer", "input") or r.op == "getitem" or r.view:
            r.time_ms = 0.0
        else:
            at = r.dtype if r.dtype in spec.peak_flops else dtype
            r.time_ms = round(roofline_ms(spec, r.flops, r.bytes_moved, at), 6)
