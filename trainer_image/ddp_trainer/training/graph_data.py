"""Graphs for the gcn workload: ogbn-products as OGB publishes it, and a products-like generator.

The layout OGB ships for a node-property dataset (``products.zip``; OGB's own loaders put it under
``<root>/ogbn_products``), every file a headerless, comma-separated, gzipped CSV::

    raw/node-feat.csv.gz        N rows x F floats          (products: 2,449,029 x 100)
    raw/node-label.csv.gz       N rows x 1 integer class   (products: 47 classes)
    raw/edge.csv.gz             E rows "src,dst"; an undirected graph stores each edge once
    raw/num-node-list.csv.gz    one row per graph: N       (a node-prediction dataset has one graph)
    raw/num-edge-list.csv.gz    one row per graph: E       (products: 61,859,140)
    split/sales_ranking/{train,valid,test}.csv.gz   one node index per row

Only numpy and the standard library: what is loaded or generated here is plain arrays, and the model
(``ddp_trainer.training.gcn``) turns them into tensors.
"""

from __future__ import annotations

import gzip
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from ddp_trainer.config import ConfigError

# The generated graph does not depend on --seed, so accuracies of different seeds are comparable.
GRAPH_SEED: Final = 20240617
OGBN_PRODUCTS_SPLIT: Final = "sales_ranking"
# Where a dataset may sit under --data-dir: the directory itself, OGB's loaders' root, or the zip's top.
DATASET_SUBDIRS: Final = ("", "ogbn_products", "products")
OGB_FIX: Final = (
    "point --data-dir at ogbn-products as OGB publishes it (products.zip from "
    "https://snap.stanford.edu/ogb/data/nodeproppred/, unzipped: raw/ and split/sales_ranking/)"
)

IntArray = np.ndarray[Any, np.dtype[np.int64]]
FloatArray = np.ndarray[Any, np.dtype[np.float32]]


@dataclass(frozen=True)
class NodeGraph:
    """One graph for node classification, as arrays.

    ``edges`` holds each undirected edge once (2 x E, like OGB's edge.csv.gz); the model adds the
    reverse direction and the self-loops.
    """

    features: FloatArray  # N x F
    labels: IntArray  # N
    edges: IntArray  # 2 x E
    train: IntArray  # node indices
    valid: IntArray
    test: IntArray
    num_classes: int

    @property
    def num_nodes(self) -> int:
        return int(self.labels.shape[0])


# --- the OGB layout ---------------------------------------------------------------------------------


def dataset_root(data_dir: Path) -> Path:
    """The directory holding raw/ and split/: --data-dir itself or one of OGB's names under it."""
    for subdir in DATASET_SUBDIRS:
        candidate = data_dir / subdir if subdir else data_dir
        if (candidate / "raw").is_dir():
            return candidate
    raise ConfigError(str(data_dir / "raw"), "no such directory (no ogbn-products dataset here)", OGB_FIX)


def _read_csv(path: Path, dtype: type[np.generic], columns: int | None = None) -> np.ndarray[Any, Any]:
    """A headerless gzipped CSV as a 2-D array; every failure is a ConfigError naming the file."""
    if not path.is_file():
        raise ConfigError(str(path), "missing", OGB_FIX)
    kind = "integers" if np.issubdtype(dtype, np.integer) else "numbers"
    try:
        with gzip.open(path, "rt", encoding="ascii", newline="") as text, warnings.catch_warnings():
            # An empty file is reported below, as one line, instead of numpy's warning.
            warnings.filterwarnings("ignore", message="loadtxt: input contained no data")
            array: np.ndarray[Any, Any] = np.loadtxt(text, delimiter=",", dtype=dtype, ndmin=2)
    except (OSError, EOFError, zlib.error) as error:
        # gzip raises BadGzipFile (an OSError) for a file that is not gzip, EOFError for a truncated one.
        raise ConfigError(str(path), f"not a readable gzip file ({_first_clause(error)})", OGB_FIX) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(str(path), f"not a CSV of {kind} ({_first_clause(error)})", OGB_FIX) from None
    if array.size == 0:
        raise ConfigError(str(path), "is empty", OGB_FIX)
    if columns is not None and array.shape[1] != columns:
        raise ConfigError(str(path), f"has {array.shape[1]} columns per row, expected {columns}", OGB_FIX)
    return array


def _first_clause(error: BaseException) -> str:
    """numpy's and gzip's messages, cut to their first line and before numpy's advice after ';'."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(";")[0].rstrip(".")


def _single_count(path: Path, what: str) -> int:
    counts = _read_csv(path, np.int64, columns=1)
    if counts.shape[0] != 1:
        raise ConfigError(
            str(path),
            f"lists {counts.shape[0]} graphs, expected one (node prediction has one graph)",
            OGB_FIX,
        )
    count = int(counts[0, 0])
    if count < 1:
        raise ConfigError(str(path), f"{what} is {count}, expected at least 1", OGB_FIX)
    return count


def _expect_rows(path: Path, array: np.ndarray[Any, Any], rows: int, source: str) -> None:
    if array.shape[0] != rows:
        raise ConfigError(str(path), f"has {array.shape[0]} rows, expected {rows} ({source})", OGB_FIX)


def _node_indices(path: Path, num_nodes: int) -> IntArray:
    indices: IntArray = _read_csv(path, np.int64, columns=1)[:, 0]
    _expect_in_range(path, indices, num_nodes)
    return indices


def _expect_in_range(path: Path, indices: IntArray, num_nodes: int) -> None:
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= num_nodes:
        bad = low if low < 0 else high
        raise ConfigError(
            str(path), f"node index {bad} is outside 0..{num_nodes - 1} (num-node-list.csv.gz)", OGB_FIX
        )


def load_ogb_node_dataset(data_dir: Path, split: str = OGBN_PRODUCTS_SPLIT) -> NodeGraph:
    """ogbn-products (or any single-graph OGB node dataset of that layout) from ``data_dir``.

    Every file is checked against the others (row counts against num-node-list / num-edge-list,
    indices in range, disjoint train and test); the first problem is a ConfigError naming the file.
    """
    root = dataset_root(data_dir)
    raw = root / "raw"
    num_nodes = _single_count(raw / "num-node-list.csv.gz", "the node count")
    num_edges = _single_count(raw / "num-edge-list.csv.gz", "the edge count")

    features_path = raw / "node-feat.csv.gz"
    features = _read_csv(features_path, np.float32)
    _expect_rows(features_path, features, num_nodes, "num-node-list.csv.gz")
    if not np.isfinite(features).all():
        raise ConfigError(str(features_path), "holds NaN or infinite values", OGB_FIX)

    labels_path = raw / "node-label.csv.gz"
    labels = _read_csv(labels_path, np.int64, columns=1)[:, 0]
    _expect_rows(labels_path, labels, num_nodes, "num-node-list.csv.gz")
    if int(labels.min()) < 0:
        raise ConfigError(str(labels_path), f"class {int(labels.min())} is negative", OGB_FIX)

    edges_path = raw / "edge.csv.gz"
    edges = _read_csv(edges_path, np.int64, columns=2)
    _expect_rows(edges_path, edges, num_edges, "num-edge-list.csv.gz")
    _expect_in_range(edges_path, edges.reshape(-1), num_nodes)

    split_dir = root / "split" / split
    train = _node_indices(split_dir / "train.csv.gz", num_nodes)
    valid = _node_indices(split_dir / "valid.csv.gz", num_nodes)
    test_path = split_dir / "test.csv.gz"
    test = _node_indices(test_path, num_nodes)
    if np.intersect1d(train, test).size:
        raise ConfigError(str(test_path), "shares nodes with train.csv.gz", OGB_FIX)
    return NodeGraph(
        features=np.ascontiguousarray(features),
        labels=np.ascontiguousarray(labels),
        edges=np.ascontiguousarray(edges.T),
        train=train,
        valid=valid,
        test=test,
        num_classes=int(labels.max()) + 1,
    )


# --- the generator ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProductsLikeShape:
    """What the generator draws. The defaults mimic ogbn-products at a small scale: 100 features,
    skewed class sizes, power-law degrees, mostly same-class edges (co-purchases of related
    products), and OGB's sales-ranking split (train on the most popular 8%, validate on the next 2%,
    test on the long tail)."""

    num_nodes: int = 20_000
    num_classes: int = 16
    feature_dim: int = 100
    average_degree: float = 20.0
    # Probability that an edge is drawn inside its source's class (a random edge joins two nodes of
    # the same class by chance too: the measured share is higher).
    homophily: float = 0.5
    # Popularity ~ Pareto(shape) + 1: the degree distribution's tail exponent is about shape + 1.
    popularity_shape: float = 1.5
    # How far apart class centroids are, against unit noise: the features alone separate the classes
    # only partly, so the neighbourhood (what a GCN adds) matters.
    feature_signal: float = 0.2
    train_fraction: float = 0.08
    valid_fraction: float = 0.02


def generate_products_like(shape: ProductsLikeShape, seed: int = GRAPH_SEED) -> NodeGraph:
    """A products-like graph; the same ``shape`` and ``seed`` give the same graph on every rank."""
    if shape.num_nodes < 2 * shape.num_classes:
        raise ValueError(f"a graph of {shape.num_classes} classes needs >= {2 * shape.num_classes} nodes")
    rng = np.random.default_rng(seed)
    n = shape.num_nodes
    class_weight = 1.0 / np.arange(1, shape.num_classes + 1) ** 0.8
    labels = rng.choice(shape.num_classes, size=n, p=class_weight / class_weight.sum()).astype(np.int64)
    # Every class present, so the split and the accuracy see all of them.
    labels[: shape.num_classes] = np.arange(shape.num_classes)
    popularity = rng.pareto(shape.popularity_shape, size=n) + 1.0
    # Cap the heaviest hubs: on a small graph one node would otherwise hold a large share of the edges.
    popularity = np.minimum(popularity, popularity.sum() / 200.0)

    num_draws = int(n * shape.average_degree / 2)
    sources = _draw_weighted(rng, popularity, num_draws)
    targets = _draw_weighted(rng, popularity, num_draws)
    same_class = rng.random(num_draws) < shape.homophily
    for klass in range(shape.num_classes):
        members = np.flatnonzero(labels == klass)
        chosen = np.flatnonzero(same_class & (labels[sources] == klass))
        targets[chosen] = members[_draw_weighted(rng, popularity[members], chosen.size)]
    edges = np.stack([np.minimum(sources, targets), np.maximum(sources, targets)])
    edges = edges[:, edges[0] != edges[1]]
    edges = np.unique(edges, axis=1)

    centroids = rng.standard_normal((shape.num_classes, shape.feature_dim))
    features = (
        shape.feature_signal * centroids[labels] + rng.standard_normal((n, shape.feature_dim))
    ).astype(np.float32)

    # The sales-ranking split: nodes by popularity, most popular first.
    by_popularity = np.argsort(-popularity, kind="stable")
    train_end = int(n * shape.train_fraction)
    valid_end = train_end + int(n * shape.valid_fraction)
    return NodeGraph(
        features=features,
        labels=labels,
        edges=edges.astype(np.int64),
        train=np.sort(by_popularity[:train_end]),
        valid=np.sort(by_popularity[train_end:valid_end]),
        test=np.sort(by_popularity[valid_end:]),
        num_classes=shape.num_classes,
    )


def _draw_weighted(rng: np.random.Generator, weights: np.ndarray[Any, Any], count: int) -> IntArray:
    """``count`` indices drawn with probability proportional to ``weights`` (with replacement)."""
    cumulative = np.cumsum(weights)
    drawn: IntArray = np.searchsorted(cumulative, rng.random(count) * cumulative[-1], side="right")
    return np.minimum(drawn, len(weights) - 1).astype(np.int64)


def degrees(graph: NodeGraph) -> IntArray:
    """Undirected degree of every node (self-loops not counted)."""
    counts: IntArray = np.bincount(graph.edges.reshape(-1), minlength=graph.num_nodes).astype(np.int64)
    return counts
