"""The integer view of a profile that the simulator and the solvers index into.

Node names become positions in `Profile.nodes`, storages stay integer ids, and per-node lists
(reads, saves, new storages, backward ends) are computed once per profile (`graph_index`).
A "forward position" k is an index into `GraphIndex.forward`, the forward nodes in execution
order: the coordinates in which regions, cuts and segments of the forward chain are written.
"""

from __future__ import annotations

import numpy as np

from solvers.profile import COLLECTIVE_PREFIX, FIXED_PHASES, Profile, cached

__all__ = ["CPU_RNG_STATE_BYTES", "GraphIndex", "IndexArrays", "graph_index"]

CPU_RNG_STATE_BYTES = 5056
"""Size of `torch.get_rng_state()` (the mt19937 state), saved by every region with random ops."""


class GraphIndex:
    """Integer view of a profile, computed once per profile and shared by all simulations."""

    def __init__(self, p: Profile) -> None:
        nodes = p.nodes
        self.n = len(nodes)
        self.names = [nd.name for nd in nodes]
        self.name_to_i = {name: i for i, name in enumerate(self.names)}
        self.phase = [nd.phase for nd in nodes]
        self.time = [nd.time_ms for nd in nodes]
        self.ws = [nd.workspace_bytes for nd in nodes]
        self.random = [nd.random for nd in nodes]
        # checkpoint(preserve_rng_state=True) keeps torch.get_rng_state() (a CPU tensor) from a
        # region's forward to its replay; on a GPU that tensor is host memory and does not count
        # towards the device's peak.
        self.rng_state_bytes = CPU_RNG_STATE_BYTES if p.meta.device == "cpu" else 0
        self.region_ms = p.meta.checkpoint_region_ms
        self.saved_tensor_ms = p.meta.checkpoint_saved_tensor_ms
        self.selective_op_ms = p.meta.checkpoint_selective_op_ms
        self.sbytes = list(p.storage_bytes)
        self.new = [list(nd.new_storages) for nd in nodes]
        self.no_grad = [nd.no_grad_storages for nd in nodes]
        self.detached = [frozenset(nd.detached_reads) for nd in nodes]
        """Storages each forward node read without an autograd edge (`Node.detached_reads`)."""
        self.fixed_storages = {
            s for i, nd in enumerate(nodes) if nd.phase in FIXED_PHASES for s in nd.new_storages
        }
        out_storage = [nd.storage for nd in nodes]
        self.out_storage = out_storage
        self.inputs_of = [[self.name_to_i[name] for name in nd.inputs] for nd in nodes]
        self.getitem = [nd.op == "getitem" for nd in nodes]
        # Storages each node reads: a tuple-valued input (multi-output op) holds all its outputs.
        all_reads: list[set[int]] = []
        for nd in nodes:
            r: set[int] = set()
            for name in nd.inputs:
                j = self.name_to_i[name]
                if out_storage[j] is not None:
                    r.add(out_storage[j])
                    r.update(nodes[j].storage_parts)  # a sparse output's indices
                else:
                    r.update(self.new[j])
            all_reads.append(r)
        self.reads = [sorted(r - self.fixed_storages) for r in all_reads]
        self.saves = [sorted(set(nd.saves)) for nd in nodes]
        # release[s]: the node after which the model's own code dropped its last reference to s
        # (recorded profiles); a storage with none dies after its last reader.
        self.release: dict[int, int] = {}
        for i, nd in enumerate(nodes):
            for s in nd.releases:
                self.release[s] = i
        self.grad_of = [
            self.name_to_i[nd.grad_of] if nd.grad_of is not None else -1 for nd in nodes
        ]
        self.python_backward = [nd.python_backward for nd in nodes]
        """Backward nodes run by a custom Function's Python backward (`Node.python_backward`)."""
        self.collectives = [i for i, nd in enumerate(nodes)
                            if nd.op.startswith(COLLECTIVE_PREFIX)]
        """Node indices of FSDP's events (`solvers.distributed`), which no region may hold."""
        self.forward = [i for i, ph in enumerate(self.phase) if ph == "forward"]
        """Node indices of the forward nodes, in execution order (forward position -> node)."""
        self.fwd_pos = {i: k for k, i in enumerate(self.forward)}
        """Node index -> forward position."""
        self.forward_names = [self.names[i] for i in self.forward]
        """Forward position -> node name."""
        self.fwd_end = max((i for i, ph in enumerate(self.phase) if ph in ("forward", "loss")),
                           default=-1)
        # bw_end[f]: the last backward op issued by f's autograd node: its saved tensors die there.
        # The engine's sums of the node's output gradients into the next nodes' buffers
        # (`Node.accumulates`) run after the formula returned and its saved tensors were
        # released; they end the node's backward only where it ran nothing else.
        self.bw_end: dict[int, int] = {}
        # bw_unpack[f]: the backward op before which f's autograd node unpacks its saved tensors
        # (where a checkpoint replays the region that saved them). A C++ formula unpacks every
        # saved tensor before its first op (IndexBackward0 unpacks the indices, then allocates
        # the zeros it scatters into); a custom Function's Python backward reads
        # `ctx.saved_tensors` where its code does, taken as its first op that reads one. The
        # node of an in-place op on a view is its base's CopySlices, which copies the gradient
        # before the formula it wraps unpacks (`Node.before_unpack`).
        self.bw_unpack: dict[int, int] = {}
        self.accumulates = accumulates = [nd.accumulates for nd in nodes]
        self.apply_end: dict[int, int] = {}
        """apply_end[f]: the last op of f's formula, before the engine's own ops on its outputs
        (`Node.after_formula`, `Node.accumulates`): a region's replayed copies that f's node
        unpacked are the formula's locals and die there (the checkpoint's frame dropped them
        as it handed them over); what the node saves itself lives to `bw_end`."""
        for i in range(self.n):
            g = self.grad_of[i]
            if g >= 0:
                if not accumulates[i] or g not in self.bw_end:
                    self.bw_end[g] = i
                if not (accumulates[i] or nodes[i].after_formula) or g not in self.apply_end:
                    self.apply_end[g] = i
                if g not in self.bw_unpack and not (accumulates[i] or nodes[i].before_unpack) and (
                        not self.python_backward[i]
                        or not all_reads[i].isdisjoint(self.saves[g])):
                    self.bw_unpack[g] = i
        for g in list(self.bw_end):
            if self.saves[g] and g not in self.bw_unpack:
                self.bw_unpack[g] = self.bw_end[g]
        # Fixed end-of-step holders: the loss and parameter gradients.
        self.end = self.n
        self.persist: set[int] = set()
        for name in (p.loss, *p.grads):
            if name:
                j = self.name_to_i[name]
                if out_storage[j] is not None:
                    self.persist.add(out_storage[j])
                    self.persist.update(nodes[j].storage_parts)  # a sparse gradient's indices
                self.persist.update(self.new[j])
        self.fixed_bytes = p.fixed_bytes
        # Autocast's cached casts: under `torch.autocast`, the first op that needs a parameter
        # in the lower precision casts it and every later op of the same autocast block reuses
        # that copy from autocast's cache, so the cast is recorded once, where it first ran.
        # A region's replay runs in an autocast block of its own (checkpoint re-enters autocast
        # in backward, with an empty cache), so a replay that reads a cast made outside its
        # region casts again: a copy of its own, not the original and not a region input.
        ac = {}
        if p.meta.autocast:
            for i, nd in enumerate(nodes):
                if (nd.phase == "forward" and nd.op == "aten._to_copy.default"
                        and len(nd.inputs) == 1 and out_storage[i] is not None
                        and nodes[self.name_to_i[nd.inputs[0]]].phase == "param"):
                    ac[out_storage[i]] = i
        self.autocast_casts: dict[int, int] = ac
        """Storages of parameters cast by autocast (from its cache) -> the node that cast them."""
        held = set(ac)
        for name in p.model_outputs:
            j = self.name_to_i[name]
            held.update([out_storage[j]] if out_storage[j] is not None else self.new[j])
            held.update(nodes[j].storage_parts)
        self.not_code_held: frozenset[int] = frozenset(held)
        """Storages whose last reference at the end of forward is not the model code's: the
        model's outputs (the caller holds them) and autocast's cached casts (its cache does,
        until the autocast block ends). Generated code that drops values early drops them no
        earlier (`solvers.simulate._original_ends`)."""
        self.call_holds = {(c.start, c.end): c.holds for c in p.calls if c.holds}
        once = {}
        for c in p.calls:
            once[c.module] = c.module not in once
        self.call_spans = {(self.name_to_i[c.start], self.name_to_i[c.end]) for c in p.calls
                           if not c.blocker and once[c.module]}
        """Node spans of the module calls a region may be on its own (no blocker, the module's
        only call): a run of stages over the same nodes is that call (`candidate_calls`)."""
        self.call_span = {c.module: (self.name_to_i[c.start], self.name_to_i[c.end])
                          for c in p.calls if c.stages}
        """Node span of each traced call, by module."""
        self.traced_calls: list[tuple[int, int, list[int], list[int]]] = []
        """(first node, last node, first node of each stage, last node of each stage) of each
        call whose forward traced (`ModuleCall.stages`): a plan with a run of its stages runs
        the traced code for the whole call (`planner.stages`)."""
        self.traced_by_first: dict[int, list[int]] = {}
        """Node -> the `traced_calls` (indices) one of whose stages starts there."""
        self.stage_args: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
        """(first node, last node) of a traced call -> `ModuleCall.stage_args`."""
        for c in p.calls:
            if c.stages and c.staged:
                firsts = [self.name_to_i[x] for x in c.stages]
                for f in firsts:
                    self.traced_by_first.setdefault(f, []).append(len(self.traced_calls))
                self.traced_calls.append((
                    self.name_to_i[c.start], self.name_to_i[c.end], firsts,
                    [self.name_to_i[x] for x in c.stage_last]))
                if c.stage_args:
                    self.stage_args[(self.name_to_i[c.start], self.name_to_i[c.end])] = \
                        c.stage_args
        self.stage_passed: dict[int, int] = {}
        """For each storage a stage of a traced call is passed (`ModuleCall.stage_args`), the
        first node of the last such stage: the generated code holds the value that reaches it
        (a tensor, or an object holding it: x-transformers' attention intermediates) until
        that stage is done, whether or not an op reads it."""
        for ca, cb, firsts, _ in self.traced_calls:
            for k, sids in enumerate(self.stage_args.get((ca, cb), ())):
                for st in sids:
                    if firsts[k] > self.stage_passed.get(st, -1):
                        self.stage_passed[st] = firsts[k]
        self.buffer_calls: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = []
        """(first node, last node, buffer storages, restored storages) of each call that updates
        buffers in place (`ModuleCall.buffers`): a region over it copies them for its replay
        (`planner.inplace`), so that the replay's updates land on the copies; those it reads
        again after the update (`ModuleCall.restores`) it also copies as its forward starts."""
        for c in p.calls:
            sids = tuple(self.out_storage[self.name_to_i[b]] for b in c.buffers
                         if b in self.name_to_i and self.out_storage[self.name_to_i[b]] is not None)
            rids = tuple(self.out_storage[self.name_to_i[b]] for b in c.restores
                         if b in self.name_to_i and self.out_storage[self.name_to_i[b]] is not None)
            if sids:
                self.buffer_calls.append((self.name_to_i[c.start], self.name_to_i[c.end], sids,
                                          rids))
        self.has_optimizer = bool(p.optimizer_state_bytes or p.optimizer_step_bytes)
        self.optimizer_step_bytes = p.optimizer_step_bytes
        self._arrays: IndexArrays | None = None
        self._dead_ends: dict[int, int] | None = None
        self._dead_saver_ends: dict[int, int] | None = None
        self._last_forward_read: dict[int, int] | None = None
        self.spans: dict[tuple[int, int], tuple[list[int], frozenset[int], frozenset[int],
                                                tuple[int, ...], tuple[int, ...], bool]] = {}
        """A region's node span -> its forward nodes, the storages they make, the storages
        they read from outside, the buffer storages its calls update, those it restores, and
        whether a node draws random numbers (the simulator's, computed once per span)."""
        self.replays: dict = {}
        self.span_arrays: dict = {}
        """`spans`' nodes, made storages and inputs as arrays (`solvers.simulate._span_arrays`)."""
        self.traced_of: dict = {}
        """The traced calls (indices into `traced_calls`) whose generated code a region runs
        (`solvers.simulate._traced_calls`), by the region's span, module and `staged`."""
        self.own_nodes: dict = {}
        """The simulator's own nodes of a region (those of no region nested in it nor of a
        call left out in it) and what follows from them (`solvers.simulate._forest`), by its
        span, the calls left out in it and the spans of the regions nested in it."""
        self.span_reads: dict = {}
        """The simulator's reads and releases of the storages each region span makes
        (`solvers.simulate._span_reads`), by span and the traced calls a replay runs."""
        """The simulator's replay of each region that saves nothing, by its span and those of
        the regions nested in it: it depends on nothing else in a schedule."""

    def arrays(self) -> IndexArrays:
        """The same facts as numpy arrays, for the simulator's vectorized passes (built once)."""
        if self._arrays is None:
            self._arrays = IndexArrays(self)
        return self._arrays

    def dead_saver_ends(self) -> dict[int, int]:
        """For each forward node that saves tensors but never ran backward (its output does not
        reach the loss: an output the model computes and drops, like CANINE's character-level
        sequence output under a classification head): the node after which its autograd node
        dies, freeing what it saved. That node lives as long as a tensor whose `grad_fn` chain
        reaches it: its outputs and, recursively, those of the nodes after it that did not run
        backward either, each until its last reader or until the model's code drops it; and
        as long as a node that read one of its outputs and ran backward, until that backward
        ran; a read through a tensor that does not require grad (`Node.detached_reads`: DoRA's
        weight norm, computed from a detached copy of the adapter's weight) holds no edge.
        Integer and boolean outputs (`Node.no_grad_storages`) have no `grad_fn`: they do
        not keep it alive (`topk`'s indices, read until backward by the ops they index)."""
        if self._dead_saver_ends is None:
            end = self.dead_ends()
            self._dead_saver_ends = {f: end[f] for f in self.forward if self.saves[f] and f in end}
        return self._dead_saver_ends

    def dead_ends(self) -> dict[int, int]:
        """For every forward node that never ran backward, the node after which its autograd
        node dies (`dead_saver_ends`); computed once."""
        if self._dead_ends is not None:
            return self._dead_ends
        if all(f in self.bw_end for f in self.forward if self.saves[f]):
            self._dead_ends = {}
            return self._dead_ends
        death: dict[int, int] = {}
        readers: dict[int, list[int]] = {}
        for i, r in enumerate(self.reads):
            for s in r:
                death[s] = i
                if self.phase[i] == "forward" and s not in self.detached[i]:
                    readers.setdefault(s, []).append(i)
        for s, i in self.release.items():
            death[s] = max(death.get(s, -1), i)
        for s in self.persist:
            death[s] = self.end
        end: dict[int, int] = {}
        for f in reversed(self.forward):
            if f in self.bw_end:
                continue
            e = f
            for s in self._outputs(f):
                e = max(e, death.get(s, f))
                for c in readers.get(s, ()):
                    if c > f and c in end:
                        e = max(e, end[c])
                    elif c > f and c in self.bw_end:
                        # a reader that ran backward holds an edge to this node until then
                        # (its formula gave no gradient for this input: a custom Function's
                        # None, a value it only compares)
                        e = max(e, self.bw_end[c])
            end[f] = e
        self._dead_ends = end
        return end

    def _outputs(self, f: int) -> set[int]:
        """Storages of the tensors node f's autograd node is the `grad_fn` of: what it makes,
        its output's, and for an item of a multi-output op (which the saves are attributed to)
        all of that op's outputs."""
        out = set(self.new[f])
        if self.out_storage[f] is not None:
            out.add(self.out_storage[f])
        no_grad = set(self.no_grad[f])
        if self.getitem[f]:
            for j in self.inputs_of[f]:
                out.update(self.new[j])
                no_grad.update(self.no_grad[j])
        return out - no_grad  # an integer output has no grad_fn: it keeps no node alive

    def last_forward_read(self) -> dict[int, int]:
        """For every storage a forward node reads, the last such node; computed once. A stage
        of a traced call that is passed a storage (`stage_passed`) reads it at its first node."""
        if self._last_forward_read is None:
            self._last_forward_read = {}
            for i in self.forward:
                for st in self.reads[i]:
                    self._last_forward_read[st] = i
            for st, i in self.stage_passed.items():
                if i > self._last_forward_read.get(st, -1):
                    self._last_forward_read[st] = i
        return self._last_forward_read

    def position(self, name: str) -> int:
        """Forward position of the forward node called `name`."""
        return self.fwd_pos[self.name_to_i[name]]


def graph_index(p: Profile) -> GraphIndex:
    """The GraphIndex of a profile, built once per profile."""
    return cached(p, "graph_index", GraphIndex)


class IndexArrays:
    """A GraphIndex's per-node and per-storage facts as int64 arrays (-1: none)."""

    def __init__(self, g: GraphIndex) -> None:
        n_st = len(g.sbytes)
        self.sbytes = np.asarray(g.sbytes, dtype=np.int64)
        self.ws = np.asarray(g.ws, dtype=np.int64)
        self.is_fixed = np.asarray([ph in FIXED_PHASES for ph in g.phase], dtype=bool)
        pairs = [(i, s) for i, r in enumerate(g.reads) for s in r]
        self.read_node = np.asarray([i for i, _ in pairs], dtype=np.int64)
        """(reader, storage) pairs: every storage each node reads, fixed memory excluded."""
        self.read_storage = np.asarray([s for _, s in pairs], dtype=np.int64)
        self.read_gradof = np.asarray(g.grad_of, dtype=np.int64)[self.read_node] \
            if pairs else np.zeros(0, dtype=np.int64)
        self.release = np.full(n_st, -1, dtype=np.int64)
        for s, i in g.release.items():
            if s not in g.fixed_storages:
                self.release[s] = i
        self.persist = np.asarray(sorted(g.persist), dtype=np.int64)
        self.not_code_held = np.zeros(n_st, dtype=bool)
        """`GraphIndex.not_code_held` as a mask over storages."""
        self.not_code_held[list(g.not_code_held)] = True
        self.formula_end = np.full(n_st, -1, dtype=np.int64)
        """Storages made by a C++ backward formula: the formula's last op (`GraphIndex.bw_end`).
        A custom Function's Python backward frees them at their last reference instead."""
        for i in range(g.fwd_end + 1, g.n):
            if g.grad_of[i] >= 0 and not g.python_backward[i] and not g.accumulates[i]:
                for s in g.new[i]:
                    self.formula_end[s] = g.bw_end[g.grad_of[i]]
        saves = [(f, s, e) for f, e in g.bw_end.items() for s in g.saves[f]
                 if s not in g.fixed_storages]
        self.save_node = np.asarray([f for f, _, _ in saves], dtype=np.int64)
        """(saver, storage, end of the saver's backward) triples, fixed memory excluded."""
        self.save_storage = np.asarray([s for _, s, _ in saves], dtype=np.int64)
        self.save_end = np.asarray([e for _, _, e in saves], dtype=np.int64)
        dead = [(f, s, e) for f, e in g.dead_saver_ends().items() for s in g.saves[f]
                if s not in g.fixed_storages]
        self.dead_save_node = np.asarray([f for f, _, _ in dead], dtype=np.int64)
        """(saver, storage, end) triples of the savers that never run backward
        (`GraphIndex.dead_saver_ends`)."""
        self.dead_save_storage = np.asarray([s for _, s, _ in dead], dtype=np.int64)
        self.dead_save_end = np.asarray([e for _, _, e in dead], dtype=np.int64)
        self.stage_passed = np.full(n_st, -1, dtype=np.int64)
        """`GraphIndex.stage_passed` as an array over storages (-1: none)."""
        for st, i in g.stage_passed.items():
            self.stage_passed[st] = i
        self.maker = np.full(n_st, -1, dtype=np.int64)
        """The op that allocates each storage (-1: a placeholder, fixed memory)."""
        self.alloc = np.zeros(g.n, dtype=np.int64)
        """Bytes each op allocates (0 for placeholders)."""
        for i in range(g.n):
            if not self.is_fixed[i]:
                for s in g.new[i]:
                    self.maker[s] = i
                    self.alloc[i] += g.sbytes[s]
