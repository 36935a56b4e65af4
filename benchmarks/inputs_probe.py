"""Batches as training code passes them, in fp32 and under bf16 autocast (the twenty-sixth probe).

    HF_HUB_OFFLINE=1 python benchmarks/inputs_probe.py [model ...] [-n 6] [--fp32-only]

What a tokenizer returns (a `BatchEncoding`, a `UserDict`) given as is to an HF BERT classifier
with a padded mask; a PyG `Data` passed whole to a GCN (``model(data)``, as most PyG code
calls its model); a batch dataclass holding inputs and targets; a CNN that normalizes its
input in place; a model that pops its labels from the batch dict it is given; and
unsupervised SimCSE (one BERT called twice on the same batch, two dropout masks, an in-batch
contrastive loss). Then as `families_probe.py` does: planned at its smallest peak and half way,
each plan verified and run on a smaller batch, and `-n` schedules near the smallest-peak one
measured.

Needs transformers and, for the GCN, ``pip install --no-deps torch_geometric`` (and its
pure-Python dependencies: aiohttp, fsspec, jinja2, psutil, pyparsing, requests, tqdm). Not
part of the test suite.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import families_probe  # noqa: E402
from tests.zoo import Case  # noqa: E402

V = 1000


def _bert(cls_name: str = "BertForSequenceClassification", **kw: Any) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=V, hidden_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, intermediate_size=512,
                                     max_position_embeddings=128, **kw)
    return getattr(transformers, cls_name)(config).train()


def _padded(rows: int, seq: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask, row i right-padded by 3 i tokens (modulo half the
    length: every row keeps at least half its tokens)."""
    real = torch.arange(seq) < torch.tensor([seq - 3 * i % (seq // 2)
                                             for i in range(rows)])[:, None]
    ids = torch.randint(5, V, (rows, seq), generator=g).masked_fill(~real, 0)
    return ids, real.long()


def _bert_batch_encoding() -> Case:
    from transformers import BatchEncoding

    g = torch.Generator().manual_seed(1)

    def batch(rows: int, seq: int) -> BatchEncoding:
        ids, mask = _padded(rows, seq, g)
        return BatchEncoding({"input_ids": ids, "attention_mask": mask,
                              "token_type_ids": torch.zeros_like(ids),
                              "labels": torch.randint(0, 2, (rows,), generator=g)})

    return Case(_bert(), batch(16, 96), None, batch(4, 40), "encoder")


class _GCN(nn.Module):
    """Four GCN layers and a node classifier; forward takes a whole `Data` and returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        from torch_geometric.nn import GCNConv

        torch.manual_seed(0)
        self.convs = nn.ModuleList(GCNConv(64 if i == 0 else 256, 256) for i in range(4))
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(256, 7)

    def forward(self, data: Any) -> torch.Tensor:
        x, edges = data.x, data.edge_index
        for conv in self.convs:
            x = self.drop(F.relu(conv(x, edges)))
        return F.cross_entropy(self.head(x)[data.train_mask], data.y[data.train_mask])


def _gcn_data() -> Case:
    from torch_geometric.data import Data

    g = torch.Generator().manual_seed(1)

    def graph(nodes: int, edges: int) -> Data:
        return Data(x=torch.randn(nodes, 64, generator=g),
                    edge_index=torch.randint(0, nodes, (2, edges), generator=g),
                    y=torch.randint(0, 7, (nodes,), generator=g),
                    train_mask=torch.rand(nodes, generator=g) < 0.5)

    return Case(_GCN().train(), (graph(4000, 40000),), lambda loss: loss,
                (graph(1000, 8000),), "plain")


@dataclasses.dataclass
class _Batch:
    features: torch.Tensor
    target: torch.Tensor
    weight: torch.Tensor


class _Regressor(nn.Module):
    """Residual MLP blocks on a batch dataclass; the loss weighs each row by the batch's
    weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 256)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(1024, 256)) for _ in range(4))
        self.out = nn.Linear(256, 1)

    def forward(self, batch: _Batch) -> torch.Tensor:
        h = self.inp(batch.features)
        for block in self.blocks:
            h = h + block(h)
        err = (self.out(h).squeeze(-1) - batch.target).square()
        return (err * batch.weight).sum() / batch.weight.sum()


def _dataclass_batch() -> Case:
    g = torch.Generator().manual_seed(1)

    def batch(rows: int) -> _Batch:
        return _Batch(torch.randn(rows, 32, generator=g), torch.randn(rows, generator=g),
                      torch.rand(rows, generator=g))

    return Case(_Regressor().train(), (batch(1024),), lambda loss: loss, (batch(256),), "plain")


class _NormalizesInPlace(nn.Module):
    """A small CNN whose forward standardizes its input batch in place (``x.sub_().div_()``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("mean", torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1))
        layers: list[nn.Module] = []
        c = 3
        for width in (32, 64, 64, 128):
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                       nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                       nn.MaxPool2d(2)]
            c = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(128, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        images.sub_(self.mean).div_(self.std)
        return self.head(self.features(images).mean((2, 3)))


def _inplace_input() -> Case:
    g = torch.Generator().manual_seed(1)
    labels = {}

    def batch(rows: int) -> tuple[torch.Tensor]:
        labels[rows] = torch.randint(0, 10, (rows,), generator=g)
        return (torch.rand(rows, 3, 64, 64, generator=g),)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels[len(logits)])

    return Case(_NormalizesInPlace().train(), batch(32), loss_fn, batch(8), "vision")


class _PopsLabels(nn.Module):
    """A BERT token classifier whose forward takes the batch dict and pops its labels (the
    loss code of many training scripts: ``labels = batch.pop("labels")``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bert = _bert("BertForTokenClassification", num_labels=5)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch.pop("labels")
        logits = self.bert(**batch).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _pops_labels() -> Case:
    g = torch.Generator().manual_seed(1)

    def batch(rows: int, seq: int) -> tuple[dict[str, torch.Tensor]]:
        ids, mask = _padded(rows, seq, g)
        labels = torch.randint(0, 5, (rows, seq), generator=g).masked_fill(mask == 0, -100)
        return ({"input_ids": ids, "attention_mask": mask, "labels": labels},)

    return Case(_PopsLabels(), batch(16, 96), lambda loss: loss, batch(4, 40), "encoder")


class _SimCSE(nn.Module):
    """Unsupervised SimCSE: the same batch through one BERT twice (two dropout masks), mean
    pooled, an in-batch InfoNCE loss at temperature 0.05."""

    def __init__(self) -> None:
        super().__init__()
        self.bert = _bert("BertModel", add_pooling_layer=False)

    def embed(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        a = F.normalize(self.embed(input_ids, attention_mask), dim=-1)
        b = F.normalize(self.embed(input_ids, attention_mask), dim=-1)
        scores = a @ b.T / 0.05
        return F.cross_entropy(scores, torch.arange(len(scores), device=scores.device))


def _simcse() -> Case:
    g = torch.Generator().manual_seed(1)

    def batch(rows: int, seq: int) -> dict[str, torch.Tensor]:
        ids, mask = _padded(rows, seq, g)
        return {"input_ids": ids, "attention_mask": mask}

    return Case(_SimCSE().train(), batch(32, 64), lambda loss: loss, batch(8, 32), "encoder")


MODELS: dict[str, Callable[[], Case]] = {
    "bert_batch_encoding": _bert_batch_encoding,
    "gcn_pyg_data": _gcn_data,
    "dataclass_batch": _dataclass_batch,
    "inplace_input": _inplace_input,
    "pops_labels": _pops_labels,
    "simcse": _simcse,
}


def main(argv: list[str] | None = None) -> int:
    return families_probe.main(argv, MODELS, "model", __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
