"""The gcn workload: a graph convolutional network (Kipf & Welling) in plain torch sparse ops.

DDP design: every rank holds the whole graph and runs the full-graph forward (message passing needs
the neighbours of every node, wherever they are), and each rank's loss covers only its own shard of
the training nodes. The shard is what ``DistributedSampler`` gives the trainer's loop: the "samples"
of this workload are training-node indices, and the model maps node indices to their logits. So
every rank makes the same number of synchronized steps, the gradients DDP averages are those of
disjoint node sets, and the trainer's loop, checkpoints and metrics work unchanged.

A layer is ``A_hat @ (X @ W) + b`` with ``A_hat = D^-1/2 (A + I) D^-1/2``, the symmetric-normalized
adjacency with self-loops, stored once as a CSR matrix. Why not PyTorch Geometric: docs/trainer.md.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_trainer.training.graph_data import (
    NodeGraph,
    ProductsLikeShape,
    generate_products_like,
    load_ogb_node_dataset,
)

DROPOUT: Final = 0.5


def normalized_adjacency(edges: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """``D^-1/2 (A + I) D^-1/2`` as a CSR tensor, from edges given in one or both directions.

    Each edge is made undirected, duplicates and self-loops in the input count once, and every node
    gets one self-loop, so no row is empty and the matrix is symmetric: its own transpose, which is
    what lets :class:`_SymmetricPropagation` reuse it for the backward pass.
    """
    loops = torch.arange(num_nodes, dtype=torch.int64)
    rows = torch.cat([edges[0], edges[1], loops])
    cols = torch.cat([edges[1], edges[0], loops])
    # One key per (row, col): unique() both dedupes and sorts in row-major order, as CSR wants.
    keys = torch.unique(rows * num_nodes + cols)
    rows, cols = keys // num_nodes, keys % num_nodes
    degree = torch.bincount(rows, minlength=num_nodes).to(torch.float32)
    scale = degree.rsqrt()
    values = scale[rows] * scale[cols]
    crow = torch.zeros(num_nodes + 1, dtype=torch.int64)
    crow[1:] = torch.cumsum(torch.bincount(rows, minlength=num_nodes), dim=0)
    with warnings.catch_warnings():
        # torch calls its CSR layout beta on every construction; the products used here are stable.
        warnings.filterwarnings(
            "ignore", message="Sparse CSR tensor support is in beta", category=UserWarning
        )
        # Built sorted and deduplicated above: checking the invariants again would only cost time.
        return torch.sparse_csr_tensor(
            crow, cols, values, size=(num_nodes, num_nodes), check_invariants=False
        )


class _SymmetricPropagation(torch.autograd.Function):
    """``A @ X`` for a constant symmetric sparse ``A``: the gradient for X is ``A.T @ grad = A @ grad``.

    torch's own sparse-CSR backward would build the transpose first; A is symmetric by construction,
    so the backward pass is the forward pass on the gradient.
    """

    @staticmethod
    def forward(ctx: Any, adjacency: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        ctx.adjacency = adjacency
        return adjacency @ dense

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, ctx.adjacency @ grad


def propagate(adjacency: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    result: torch.Tensor = _SymmetricPropagation.apply(adjacency, dense)
    return result


class GraphConvolution(nn.Module):
    """One GCN layer: transform, then average over the normalized neighbourhood, then the bias."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        # Transforming before propagating keeps the sparse product at the narrower width.
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, adjacency: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return propagate(adjacency, self.linear(features)) + self.bias


@dataclass
class _GraphOnDevice:
    adjacency: torch.Tensor
    features: torch.Tensor


class NodeClassifier(nn.Module):
    """A GCN over one fixed graph: ``forward(node_indices)`` gives those nodes' class logits.

    The graph (normalized adjacency and node features) is held outside the module's parameters and
    buffers on purpose: DDP would otherwise broadcast it from rank 0 at construction and, with
    ``broadcast_buffers``, before every forward; checkpoints would carry it and the parameter digest
    would hash it. Every rank builds the same graph from the same files or seed instead, and the
    graph follows the parameters to their device on first use.
    """

    def __init__(
        self,
        adjacency: torch.Tensor,
        features: torch.Tensor,
        num_classes: int,
        hidden: int,
        layers: int,
        dropout: float = DROPOUT,
    ) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"a GCN needs at least one layer, got {layers}")
        widths = [features.shape[1]] + [hidden] * (layers - 1) + [num_classes]
        self.convolutions = nn.ModuleList(
            GraphConvolution(width_in, width_out) for width_in, width_out in itertools.pairwise(widths)
        )
        self.dropout = dropout
        self._host_graph = _GraphOnDevice(adjacency, features)
        self._device_graph = self._host_graph

    def _graph(self, device: torch.device) -> _GraphOnDevice:
        if self._device_graph.features.device != device:
            self._device_graph = _GraphOnDevice(
                self._host_graph.adjacency.to(device), self._host_graph.features.to(device)
            )
        return self._device_graph

    def forward(self, nodes: torch.Tensor) -> torch.Tensor:
        graph = self._graph(nodes.device)
        hidden = graph.features
        last = len(self.convolutions) - 1
        for index, convolution in enumerate(self.convolutions):
            hidden = convolution(graph.adjacency, hidden)
            if index < last:
                # Dropout on the hidden layers only, as OGB's products baselines do: on CPUs drawing
                # the mask for the input features as well costs as much as a sparse product.
                hidden = nn.functional.dropout(torch.relu(hidden), self.dropout, self.training)
        return hidden[nodes]


def load_graph(source: str, data_dir: Path, num_nodes: int) -> NodeGraph:
    if source == "generated":
        return generate_products_like(ProductsLikeShape(num_nodes=num_nodes))
    if source == "ogbn-products":
        return load_ogb_node_dataset(data_dir)
    raise ValueError(f"unknown graph source {source!r}")


@dataclass(frozen=True)
class GraphWorkload:
    model: NodeClassifier
    train: TensorDataset
    test: TensorDataset


def build_gcn_workload(graph: NodeGraph, hidden: int, layers: int, seed: int) -> GraphWorkload:
    """The model (seeded: every rank builds the same one) and the train/test node sets.

    The datasets hold node indices and their labels: the trainer shards the training nodes across
    ranks and the held-out accuracy is over the test nodes.
    """
    features = torch.from_numpy(graph.features)
    labels = torch.from_numpy(graph.labels)
    adjacency = normalized_adjacency(torch.from_numpy(graph.edges), graph.num_nodes)
    torch.manual_seed(seed)
    model = NodeClassifier(adjacency, features, graph.num_classes, hidden=hidden, layers=layers)
    train = torch.from_numpy(np.asarray(graph.train))
    test = torch.from_numpy(np.asarray(graph.test))
    return GraphWorkload(
        model=model, train=TensorDataset(train, labels[train]), test=TensorDataset(test, labels[test])
    )
