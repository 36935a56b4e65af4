"""The integer view of a profile that the simulator and the solvers index into.

Node names become positions in `Profile.nodes`, storages stay integer ids, and per-node lists
(reads, saves, new storages, backward ends) are computed once per profile (`graph_index`).
A "forward position" k is an index into `GraphIndex.forward`, the forward nodes in execution
order: the coordinates in which regions, cuts and segments of the forward chain are written.
"""

from __future__ import annotations

from solvers.profile import COLLECTIVE_PREFIX, FIXED_PHASES, Profile, cached

__all__ = ["CPU_RNG_STATE_BYTES", "GraphIndex", "graph_index"]

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
        self.fixed_storages = {
            s for i, nd in enumerate(nodes) if nd.phase in FIXED_PHASES for s in nd.new_storages
        }
        out_storage = [nd.storage for nd in nodes]
        # Storages each node reads: a tuple-valued input (multi-output op) holds all its outputs.
        all_reads: list[set[int]] = []
        for nd in nodes:
            r: set[int] = set()
            for name in nd.inputs:
                j = self.name_to_i[name]
                if out_storage[j] is not None:
                    r.add(out_storage[j])
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
        self.bw_end: dict[int, int] = {}
        self.bw_first_read: dict[int, int] = {}
        for i in range(self.n):
            g = self.grad_of[i]
            if g >= 0:
                self.bw_end[g] = i
                if g not in self.bw_first_read and not all_reads[i].isdisjoint(self.saves[g]):
                    self.bw_first_read[g] = i
        for g in list(self.bw_end):
            if self.saves[g] and g not in self.bw_first_read:
                self.bw_first_read[g] = self.bw_end[g]
        # Fixed end-of-step holders: the loss and parameter gradients.
        self.end = self.n
        self.persist: set[int] = set()
        for name in (p.loss, *p.grads):
            if name:
                j = self.name_to_i[name]
                if out_storage[j] is not None:
                    self.persist.add(out_storage[j])
                self.persist.update(self.new[j])
        self.fixed_bytes = p.fixed_bytes
        self.call_holds = {(c.start, c.end): c.holds for c in p.calls if c.holds}
        self.has_optimizer = bool(p.optimizer_state_bytes or p.optimizer_step_bytes)
        self.optimizer_step_bytes = p.optimizer_step_bytes

    def position(self, name: str) -> int:
        """Forward position of the forward node called `name`."""
        return self.fwd_pos[self.name_to_i[name]]


def graph_index(p: Profile) -> GraphIndex:
    """The GraphIndex of a profile, built once per profile."""
    return cached(p, "graph_index", GraphIndex)
