"""Sparse tensors in a training step, planned and verified (the twelfth probe): graph networks
whose adjacency is a sparse tensor (``torch.sparse.mm`` on COO and CSR, an adjacency held as
a buffer, learned edge weights in a sparse tensor's values, ``torch.sparse.softmax``
attention), a graph attention network written with ``scatter_reduce``/``index_add``, and a
DLRM-style recommender with ``nn.EmbeddingBag`` tables, with dense and with sparse gradients.

    python benchmarks/sparse_probe.py        # a Markdown table, about a minute

Each model is planned at its smallest peak and half way from there to no checkpointing;
`Plan.verify` measures the planned step's peak and compares loss and gradients with the
unplanned step's. Then the planned model and an unplanned copy train 3 SGD steps from the
same state, and their parameters and buffers are compared. The last column is estimate mode
(fake tensors, no step run) against the measured unplanned peak.
"""

from __future__ import annotations

import copy
import itertools
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import planner  # noqa: E402
from benchmarks._probe import floor_and_half_way, max_rel_diff, train  # noqa: E402
from solvers.errors import CkptPlannerError  # noqa: E402
from solvers.simulate import simulate  # noqa: E402


class GCNLayer(nn.Module):
    """Kipf & Welling's propagation, ``A @ (X W)``, with A a sparse tensor (COO or CSR)."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, adj):
        return F.relu(torch.sparse.mm(adj, self.lin(x))) + x


class EdgeWeighted(nn.Module):
    """Edge weights learned from the endpoints, put in a sparse tensor's values: its gradient
    reaches them through the sparse tensor."""

    def __init__(self, d: int):
        super().__init__()
        self.lin, self.w = nn.Linear(d, d), nn.Linear(d, 1)

    def forward(self, x, edge):
        w = torch.sigmoid(self.w(x[edge[0]] * x[edge[1]])).squeeze(-1)
        adj = torch.sparse_coo_tensor(edge, w, (x.shape[0], x.shape[0]))
        return F.relu(torch.sparse.mm(adj, self.lin(x))) + x


class SparseAttention(nn.Module):
    """Graph attention with ``torch.sparse.softmax`` over each node's in-edges: the sparse
    scores (values a leaky ReLU made, indices a flip of the edge list) are saved by autograd."""

    def __init__(self, d: int):
        super().__init__()
        self.lin, self.a = nn.Linear(d, d), nn.Linear(2 * d, 1)

    def forward(self, x, edge):
        h = self.lin(x)
        e = F.leaky_relu(self.a(torch.cat([h[edge[1]], h[edge[0]]], -1)).squeeze(-1), 0.2)
        n = x.shape[0]
        att = torch.sparse.softmax(torch.sparse_coo_tensor(edge.flip(0), e, (n, n)), 1)
        return F.elu(torch.sparse.mm(att, h)) + x


class ScatterAttention(nn.Module):
    """The same attention written densely, as PyG does: a softmax by ``scatter_reduce`` and
    ``index_add`` over the edge list."""

    def __init__(self, d: int):
        super().__init__()
        self.lin, self.a = nn.Linear(d, d), nn.Parameter(torch.randn(2 * d) * 0.1)

    def forward(self, x, edge):
        h, (src, dst), n = self.lin(x), edge, x.shape[0]
        e = F.leaky_relu(torch.cat([h[src], h[dst]], -1) @ self.a, 0.2)
        m = torch.full((n,), -1e9).scatter_reduce(0, dst, e, "amax", include_self=True)
        w = (e - m[dst]).exp()
        w = w / (torch.zeros(n).index_add(0, dst, w)[dst] + 1e-9)
        return F.elu(torch.zeros_like(h).index_add(0, dst, h[src] * w[:, None])) + x


LAYERS = {"gcn": GCNLayer, "edge": EdgeWeighted, "sparse_attention": SparseAttention,
          "scatter_attention": ScatterAttention}


class GNN(nn.Module):
    def __init__(self, kind: str, d: int = 64, layers: int = 4, classes: int = 10):
        super().__init__()
        self.layers = nn.ModuleList(LAYERS[kind](d) for _ in range(layers))
        self.out = nn.Linear(d, classes)

    def forward(self, x, graph):
        for layer in self.layers:
            x = layer(x, graph)
        return self.out(x)


class BufferedGCN(GNN):
    """A GCN over one fixed graph, its normalised adjacency a (sparse) buffer."""

    def __init__(self, adj: torch.Tensor, d: int = 64):
        super().__init__("gcn", d)
        self.register_buffer("adj", adj)

    def forward(self, x):
        return super().forward(x, self.adj)


class DLRM(nn.Module):
    """Naumov et al. 2019: a bottom MLP over dense features, one `EmbeddingBag` table per
    categorical feature, pairwise dot-product interactions, a top MLP."""

    def __init__(self, sparse: bool, rows: int = 50000, d: int = 64, tables: int = 4):
        super().__init__()
        self.embs = nn.ModuleList(nn.EmbeddingBag(rows, d, mode="sum", sparse=sparse)
                                  for _ in range(tables))
        self.bot = nn.Sequential(nn.Linear(13, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU())
        n = tables + 1
        self.top = nn.Sequential(nn.Linear(d + n * (n - 1) // 2, 256), nn.ReLU(),
                                 nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, dense, idx, offsets):
        z = [self.bot(dense)] + [e(idx[i], offsets) for i, e in enumerate(self.embs)]
        t = torch.stack(z, 1)
        inter = t @ t.transpose(1, 2)
        i, j = torch.tril_indices(len(z), len(z), -1)
        return self.top(torch.cat([z[0], inter[:, i, j]], 1)).squeeze(1)


Case = tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]


def graph(nodes: int = 2000, edges: int = 16000, d: int = 64
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Node features, an edge list, a sparse COO adjacency with random weights, labels."""
    edge = torch.randint(0, nodes, (2, edges))
    adj = torch.sparse_coo_tensor(edge, torch.rand(edges), (nodes, nodes)).coalesce()
    return torch.randn(nodes, d), edge, adj, torch.randint(0, 10, (nodes,))


def dlrm_batch(batch: int = 512, rows: int = 50000, tables: int = 4, bag: int = 3):
    return (torch.randn(batch, 13), torch.randint(0, rows, (tables, batch * bag)),
            torch.arange(0, batch * bag, bag)), torch.rand(batch)


def cases() -> Iterator[tuple[str, Callable[[], Case]]]:
    def gnn(kind: str, layout: str = "edges") -> Callable[[], Case]:
        def build() -> Case:
            torch.manual_seed(0)
            x, edge, adj, y = graph()
            g = {"edges": edge, "coo": adj, "csr": adj.to_sparse_csr()}[layout]
            return GNN(kind), (x, g), lambda o: F.cross_entropy(o, y)
        return build

    yield "GCN, COO adjacency", gnn("gcn", "coo")
    yield "GCN, CSR adjacency", gnn("gcn", "csr")

    def buffered() -> Case:
        torch.manual_seed(0)
        x, _, adj, y = graph()
        return BufferedGCN(adj), x, lambda o: F.cross_entropy(o, y)
    yield "GCN, adjacency buffer", buffered
    yield "learned edge weights", gnn("edge")
    yield "sparse.softmax attention", gnn("sparse_attention")
    yield "scatter attention (dense)", gnn("scatter_attention")

    for sparse in (False, True):
        def dlrm(sparse: bool = sparse) -> Case:
            torch.manual_seed(0)
            inputs, t = dlrm_batch()
            return DLRM(sparse), inputs, \
                lambda o: F.binary_cross_entropy_with_logits(o, t)
        yield f"DLRM, {'sparse' if sparse else 'dense'} gradients", dlrm


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().to_dense() if t.layout != torch.strided else t.detach().clone()
            for t in (*model.parameters(), *model.buffers())]


def _train(model: nn.Module, inputs: Any, loss_fn) -> list[torch.Tensor]:
    """3 SGD steps from seed 1; the model's state after them."""
    train(model, inputs, loss_fn)
    return _state(model)


def main() -> int:
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    print("| model | budget | plan | predicted - measured peak B | verify | 3 steps against "
          "the unplanned model (max rel diff) | estimate mode - measured, no plan |")
    print("|---|---|---|---|---|---|---|")
    for name, build in cases():
        model, inputs, loss_fn = build()
        twin = copy.deepcopy(model)
        try:
            est = planner.profile(copy.deepcopy(model), inputs, loss_fn=loss_fn,
                                  mode="estimate", device="h100")
        except CkptPlannerError as e:  # fake tensors cannot know a sparse result's size
            est = "refused: sparse tensors in forward" if "sparse tensors" in str(e) \
                else f"fails: {str(e)[:90]}"
        runs = floor_and_half_way(model, inputs, loss_fn)
        try:
            first = next(runs)
        except CkptPlannerError as e:
            print(f"| {name} | | does not plan: {str(e).splitlines()[0][:160]} | | | | |")
            continue
        for label, p, none in itertools.chain([first], runs):
            v = p.verify()
            diff = max_rel_diff(_train(model, inputs, loss_fn),
                                _train(copy.deepcopy(twin), inputs, loss_fn))
            for a, b in zip(model.parameters(), twin.parameters(), strict=True):
                with torch.no_grad():
                    a.copy_(b)  # the next plan starts from the same weights
            shown = f"{p.schedule.method}, {len(p.schedule.regions)} regions, " \
                    f"{p.predicted_peak_bytes / none:.0%} of none"
            estimate = "" if label != "smallest peak" else est if isinstance(est, str) else \
                f"{simulate(est).peak_bytes - v.measured_none_peak_bytes:+d}"
            print(f"| {name} | {label} | {shown} | "
                  f"{p.predicted_peak_bytes - v.measured_peak_bytes:+d} | "
                  f"gradients {v.max_grad_rel_err:.0e} | {diff:.0e} | "
                  f"{estimate} |")
        planner.remove(model)
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
