"""The gcn workload's data: the ogbn-products layout as OGB publishes it, and the products-like generator.

The datasets here are written by the test itself, file by file, as OGB ships them (headerless,
comma-separated, gzipped CSV under raw/ and split/sales_ranking/), not by any writer of ours, so a
reader bug cannot hide behind a matching writer bug.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from ddp_trainer.config import ConfigError
from ddp_trainer.training.graph_data import (
    NodeGraph,
    ProductsLikeShape,
    dataset_root,
    degrees,
    generate_products_like,
    load_ogb_node_dataset,
)

pytestmark = pytest.mark.unit

# A 6-node, 3-class graph: two triangles joined by the edge 2-3, each edge stored once.
FEATURES = [[0.5, -1.0], [0.25, 0.0], [1.5, 2.0], [-0.125, 3.0], [4.0, -2.5], [0.0, 0.75]]
LABELS = [0, 0, 1, 1, 2, 2]
EDGES = [(0, 1), (1, 2), (0, 2), (2, 3), (3, 4), (4, 5), (3, 5)]
SPLIT = {"train": [0, 2, 4], "valid": [1], "test": [3, 5]}


def _write_gz(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="ascii") as out:
        out.write(text)


def _rows(rows: Sequence[Sequence[object]]) -> str:
    return "".join(",".join(str(value) for value in row) + "\n" for row in rows)


def write_ogb_dataset(root: Path) -> Path:
    """The small graph in OGB's layout under ``root``; returns ``root``."""
    raw = root / "raw"
    _write_gz(raw / "node-feat.csv.gz", _rows(FEATURES))
    _write_gz(raw / "node-label.csv.gz", _rows([[label] for label in LABELS]))
    _write_gz(raw / "edge.csv.gz", _rows(EDGES))
    _write_gz(raw / "num-node-list.csv.gz", f"{len(LABELS)}\n")
    _write_gz(raw / "num-edge-list.csv.gz", f"{len(EDGES)}\n")
    for name, nodes in SPLIT.items():
        _write_gz(root / "split" / "sales_ranking" / f"{name}.csv.gz", _rows([[node] for node in nodes]))
    return root


def test_loads_the_ogb_layout_as_written(tmp_path: Path) -> None:
    graph = load_ogb_node_dataset(write_ogb_dataset(tmp_path))
    assert graph.features.dtype == np.float32 and graph.features.tolist() == FEATURES
    assert graph.labels.tolist() == LABELS
    assert [tuple(edge) for edge in graph.edges.T.tolist()] == EDGES
    assert (graph.train.tolist(), graph.valid.tolist(), graph.test.tolist()) == (
        SPLIT["train"],
        SPLIT["valid"],
        SPLIT["test"],
    )
    assert (graph.num_nodes, graph.num_classes) == (6, 3)


@pytest.mark.parametrize(
    "subdir",
    [
        pytest.param("", id="data-dir-is-the-dataset"),
        pytest.param("ogbn_products", id="ogb-loader-root"),
        pytest.param("products", id="unzipped-products-zip"),
    ],
)
def test_finds_the_dataset_under_the_names_ogb_uses(tmp_path: Path, subdir: str) -> None:
    root = tmp_path / subdir if subdir else tmp_path
    write_ogb_dataset(root)
    assert dataset_root(tmp_path) == root
    assert load_ogb_node_dataset(tmp_path).num_nodes == 6


def _replace(relative: str, content: str) -> Callable[[Path], Path]:
    def damage(root: Path) -> Path:
        _write_gz(root / relative, content)
        return root / relative

    return damage


def _remove(relative: str) -> Callable[[Path], Path]:
    def damage(root: Path) -> Path:
        (root / relative).unlink()
        return root / relative

    return damage


def _raw_bytes(relative: str, content: bytes) -> Callable[[Path], Path]:
    def damage(root: Path) -> Path:
        (root / relative).write_bytes(content)
        return root / relative

    return damage


def _truncate(relative: str) -> Callable[[Path], Path]:
    def damage(root: Path) -> Path:
        path = root / relative
        path.write_bytes(path.read_bytes()[:-12])
        return path

    return damage


FEAT = "raw/node-feat.csv.gz"
LABEL = "raw/node-label.csv.gz"
EDGE = "raw/edge.csv.gz"
TEST_SPLIT = "split/sales_ranking/test.csv.gz"


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        pytest.param(_remove(EDGE), "missing", id="edges-missing"),
        pytest.param(_remove("raw/num-node-list.csv.gz"), "missing", id="node-count-missing"),
        pytest.param(_remove(TEST_SPLIT), "missing", id="test-split-missing"),
        pytest.param(_raw_bytes(FEAT, b"0.5,-1.0\n"), "not a readable gzip file", id="features-not-gzipped"),
        pytest.param(_truncate(FEAT), "not a readable gzip file", id="features-truncated"),
        pytest.param(_replace(FEAT, ""), "is empty", id="features-empty"),
        pytest.param(
            _replace(FEAT, _rows(FEATURES[:-1])), "has 5 rows, expected 6", id="features-row-missing"
        ),
        pytest.param(
            _replace(FEAT, _rows([*FEATURES[:3], [1.0], *FEATURES[4:]])),
            "not a CSV of numbers",
            id="features-ragged-row",
        ),
        pytest.param(
            _replace(FEAT, _rows([*FEATURES[:5], ["nan", 1.0]])), "NaN or infinite", id="features-nan"
        ),
        pytest.param(
            _replace(LABEL, _rows([[0], [0], ["shoes"], [1], [2], [2]])),
            "not a CSV of integers",
            id="label-not-a-number",
        ),
        pytest.param(
            _replace(LABEL, _rows([[0], [0], [1], [1], [2], [-1]])), "negative", id="label-negative"
        ),
        pytest.param(
            _replace(LABEL, _rows([[label, 0] for label in LABELS])),
            "has 2 columns per row, expected 1",
            id="label-two-columns",
        ),
        pytest.param(_replace(EDGE, _rows([*EDGES, (5, 6)])), "expected 7", id="edges-more-than-counted"),
        pytest.param(
            _replace(EDGE, _rows([*EDGES[:-1], (5, 6)])), "node index 6 is outside 0..5", id="edge-to-no-node"
        ),
        pytest.param(
            _replace(EDGE, _rows([(a, b, 1) for a, b in EDGES])),
            "has 3 columns per row, expected 2",
            id="edges-with-a-weight-column",
        ),
        pytest.param(
            _replace("raw/num-node-list.csv.gz", "6\n6\n"), "lists 2 graphs, expected one", id="two-graphs"
        ),
        pytest.param(
            _replace(TEST_SPLIT, _rows([[3], [-1]])),
            "node index -1 is outside 0..5",
            id="test-index-negative",
        ),
        pytest.param(
            _replace(TEST_SPLIT, _rows([[3], [4]])), "shares nodes with train", id="test-overlaps-train"
        ),
    ],
)
def test_a_malformed_dataset_is_one_line_naming_the_file(
    tmp_path: Path, damage: Callable[[Path], Path], problem: str
) -> None:
    root = write_ogb_dataset(tmp_path)
    damaged = damage(root)
    with pytest.raises(ConfigError) as raised:
        load_ogb_node_dataset(root)
    message = str(raised.value)
    assert raised.value.variable == str(damaged)
    assert problem in raised.value.problem, message
    assert "\n" not in message and message.startswith(f"{damaged}: ")
    assert "products.zip" in raised.value.fix


def test_a_data_dir_without_a_dataset_names_the_missing_raw_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        load_ogb_node_dataset(tmp_path)
    assert raised.value.variable == str(tmp_path / "raw")


# --- the generator ----------------------------------------------------------------------------------

SMALL = ProductsLikeShape(num_nodes=4000)


@pytest.fixture(scope="module")
def generated() -> NodeGraph:
    return generate_products_like(SMALL)


def test_the_generated_graph_is_the_same_for_every_rank() -> None:
    first, second = generate_products_like(SMALL), generate_products_like(SMALL)
    for name in ("features", "labels", "edges", "train", "valid", "test"):
        assert np.array_equal(getattr(first, name), getattr(second, name)), name
    other_seed = generate_products_like(SMALL, seed=1)
    assert not np.array_equal(first.edges, other_seed.edges)


def test_the_generated_graph_has_power_law_degrees(generated: NodeGraph) -> None:
    degree = degrees(generated)
    assert degree.mean() == pytest.approx(SMALL.average_degree, rel=0.25)
    # A heavy tail: hubs far above the typical node, and the top 1% of nodes hold a large share of
    # the edge ends (a Poisson graph of the same mean would give them about 2%).
    assert degree.max() > 20 * np.median(degree)
    top = np.sort(degree)[::-1][: len(degree) // 100]
    assert top.sum() / degree.sum() > 0.08


def test_the_generated_graph_is_simple_and_stored_once_per_edge(generated: NodeGraph) -> None:
    sources, targets = generated.edges
    assert (sources < targets).all()  # no self-loops, one direction per undirected edge
    assert len(np.unique(sources * generated.num_nodes + targets)) == len(sources)


def test_generated_classes_show_in_the_features_and_the_edges(generated: NodeGraph) -> None:
    labels, features = generated.labels, generated.features
    assert set(labels.tolist()) == set(range(SMALL.num_classes))
    # Nearest class centroid on the features alone beats the majority class, but not by everything:
    # the neighbourhood is meant to matter.
    centroids = np.stack([features[labels == k].mean(axis=0) for k in range(SMALL.num_classes)])
    nearest = np.argmin(((features[:, None, :] - centroids[None]) ** 2).sum(axis=2), axis=1)
    majority = np.bincount(labels).max() / len(labels)
    assert majority + 0.15 < (nearest == labels).mean() < 0.9
    sources, targets = generated.edges
    same_class = (labels[sources] == labels[targets]).mean()
    by_chance = ((np.bincount(labels) / len(labels)) ** 2).sum()
    assert same_class > by_chance + 0.3


def test_the_generated_split_follows_sales_ranking(generated: NodeGraph) -> None:
    train, valid, test = generated.train, generated.valid, generated.test
    assert (len(train), len(valid), len(test)) == (320, 80, 3600)
    assert len(np.unique(np.concatenate([train, valid, test]))) == generated.num_nodes
    # Train on the most popular products, test on the long tail: popularity shows in the degree.
    degree = degrees(generated)
    assert degree[train].mean() > 3 * degree[test].mean()


def test_a_graph_too_small_for_its_classes_is_refused() -> None:
    with pytest.raises(ValueError, match="needs >= 32 nodes"):
        generate_products_like(ProductsLikeShape(num_nodes=20))
