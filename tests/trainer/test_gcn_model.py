"""The GCN of the gcn workload against the textbook formulas, computed densely on small graphs (in the
trainer tier because it needs torch; no process group)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddp_trainer.training.gcn import (
    GraphConvolution,
    NodeClassifier,
    build_gcn_workload,
    normalized_adjacency,
    propagate,
)
from ddp_trainer.training.graph_data import NodeGraph

pytestmark = pytest.mark.trainer

NUM_NODES = 5
# A path 0-1-2-3 and a node 4 joined only to 0.
UNDIRECTED = [(0, 1), (1, 2), (2, 3), (0, 4)]


def dense_normalized(edges: list[tuple[int, int]], num_nodes: int) -> torch.Tensor:
    """D^-1/2 (A + I) D^-1/2 from its definition."""
    adjacency = torch.eye(num_nodes)
    for source, target in edges:
        if source != target:
            adjacency[source, target] = adjacency[target, source] = 1.0
    scale = adjacency.sum(dim=1).rsqrt()
    return scale[:, None] * adjacency * scale[None, :]


def as_edge_tensor(edges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(edges, dtype=torch.int64).T


@pytest.mark.parametrize(
    "given",
    [
        pytest.param(UNDIRECTED, id="each-edge-once"),
        pytest.param(UNDIRECTED + [(b, a) for a, b in UNDIRECTED], id="both-directions"),
        pytest.param(UNDIRECTED + UNDIRECTED[:2], id="duplicated-edges"),
        pytest.param([*UNDIRECTED, (3, 3)], id="a-self-loop-in-the-input"),
    ],
)
def test_normalized_adjacency_is_the_symmetric_normalization_with_self_loops(
    given: list[tuple[int, int]],
) -> None:
    built = normalized_adjacency(as_edge_tensor(given), NUM_NODES)
    assert built.layout == torch.sparse_csr
    expected = dense_normalized(UNDIRECTED, NUM_NODES)
    torch.testing.assert_close(built.to_dense(), expected)
    torch.testing.assert_close(built.to_dense(), built.to_dense().T)


def test_propagation_and_its_gradient_match_dense_autograd() -> None:
    adjacency = normalized_adjacency(as_edge_tensor(UNDIRECTED), NUM_NODES)
    dense_adjacency = dense_normalized(UNDIRECTED, NUM_NODES)
    features = torch.randn(NUM_NODES, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    weights = torch.randn(NUM_NODES, 3, generator=torch.Generator().manual_seed(1))

    (propagate(adjacency, features) * weights).sum().backward()
    assert features.grad is not None
    sparse_grad = features.grad.clone()
    features.grad = None
    (dense_adjacency @ features * weights).sum().backward()

    torch.testing.assert_close(propagate(adjacency, features.detach()), dense_adjacency @ features.detach())
    torch.testing.assert_close(sparse_grad, features.grad)


def _model(hidden: int = 4, layers: int = 2) -> NodeClassifier:
    torch.manual_seed(0)
    features = torch.randn(NUM_NODES, 3, generator=torch.Generator().manual_seed(2))
    adjacency = normalized_adjacency(as_edge_tensor(UNDIRECTED), NUM_NODES)
    return NodeClassifier(adjacency, features, num_classes=2, hidden=hidden, layers=layers)


@pytest.mark.parametrize(
    ("layers", "shapes"),
    [
        # Per layer the bias (the layer's own parameter), then the weight of its linear transform.
        pytest.param(1, [(2,), (2, 3)], id="one-layer"),
        pytest.param(2, [(4,), (4, 3), (2,), (2, 4)], id="two-layers"),
        pytest.param(3, [(4,), (4, 3), (4,), (4, 4), (2,), (2, 4)], id="three-layers"),
    ],
)
def test_the_model_holds_only_its_weights(layers: int, shapes: list[tuple[int, ...]]) -> None:
    """The graph stays out of parameters, buffers and state_dict: DDP must not broadcast it, and
    checkpoints and the parameter digest must not carry it."""
    model = _model(layers=layers)
    assert [tuple(p.shape) for p in model.parameters()] == shapes
    assert list(model.buffers()) == []
    assert [tuple(t.shape) for t in model.state_dict().values()] == shapes


def test_the_model_is_a_textbook_gcn_over_the_whole_graph() -> None:
    model = _model().eval()
    first, second = (layer for layer in model.convolutions if isinstance(layer, GraphConvolution))
    dense = dense_normalized(UNDIRECTED, NUM_NODES)
    features = model._host_graph.features
    hidden = torch.relu(dense @ first.linear(features) + first.bias)
    expected = dense @ second.linear(hidden) + second.bias
    nodes = torch.tensor([4, 0, 2])
    with torch.no_grad():
        torch.testing.assert_close(model(nodes), expected[nodes])


def test_a_loss_on_some_nodes_reaches_every_weight() -> None:
    model = _model().train()
    torch.nn.functional.cross_entropy(model(torch.tensor([1])), torch.tensor([0])).backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())


def test_the_workload_shards_training_nodes_and_holds_out_test_nodes() -> None:
    graph = NodeGraph(
        features=np.arange(12, dtype=np.float32).reshape(6, 2),
        labels=np.array([0, 1, 2, 0, 1, 2]),
        edges=np.array([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]),
        train=np.array([1, 4]),
        valid=np.array([0]),
        test=np.array([2, 3, 5]),
        num_classes=3,
    )
    workload = build_gcn_workload(graph, hidden=8, layers=2, seed=0)
    train_nodes, train_labels = workload.train.tensors
    test_nodes, test_labels = workload.test.tensors
    assert (train_nodes.tolist(), train_labels.tolist()) == ([1, 4], [1, 1])
    assert (test_nodes.tolist(), test_labels.tolist()) == ([2, 3, 5], [2, 0, 2])
    assert workload.model(test_nodes).shape == (3, 3)
    again = build_gcn_workload(graph, hidden=8, layers=2, seed=0)
    assert all(
        torch.equal(a, b)
        for a, b in zip(workload.model.state_dict().values(), again.model.state_dict().values(), strict=True)
    )
