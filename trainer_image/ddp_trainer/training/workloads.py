"""The workloads: digits (offline, real data), mnist (IDX files), synthetic (an MLP) and gcn (ddp_trainer.training.gcn)."""

from __future__ import annotations

import os
import tempfile
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_trainer.config import TrainConfig
from ddp_trainer.training.idx import read_idx

NUM_CLASSES: Final = 10
# The held-out split does not depend on --seed, so accuracies of different seeds are comparable.
SPLIT_SEED: Final = 20240601
MNIST_FILES: Final = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


@dataclass(frozen=True)
class Workload:
    name: str
    model: nn.Module
    train: TensorDataset
    test: TensorDataset


def flatten_linear(input_features: int) -> nn.Module:
    """The model of the classic MNIST DDP tutorial: Flatten, then one Linear layer to the 10 classes."""
    return nn.Sequential(nn.Flatten(), nn.Linear(input_features, NUM_CLASSES))


def mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, NUM_CLASSES))
    return nn.Sequential(*layers)


def _split(
    features: torch.Tensor, labels: torch.Tensor, test_fraction: float
) -> tuple[TensorDataset, TensorDataset]:
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    cut = len(labels) - int(len(labels) * test_fraction)
    train, test = order[:cut], order[cut:]
    return TensorDataset(features[train], labels[train]), TensorDataset(features[test], labels[test])


def digits_data() -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    # Pixel intensities are 0..16.
    features = torch.tensor(np.asarray(bunch.data) / 16.0, dtype=torch.float32).reshape(-1, 8, 8)
    labels = torch.tensor(np.asarray(bunch.target), dtype=torch.long)
    return _split(features, labels, test_fraction=0.2)


def _download(url: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several local processes may download at once: each writes its own temporary file, the rename is atomic.
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(handle, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
            while chunk := response.read(1 << 20):
                out.write(chunk)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def mnist_data(data_dir: Path, base_url: str) -> tuple[TensorDataset, TensorDataset]:
    arrays = {}
    for key, filename in MNIST_FILES.items():
        path = data_dir / filename
        if not path.exists():
            _download(base_url.rstrip("/") + "/" + filename, path)
        arrays[key] = read_idx(path)

    def dataset(images: np.ndarray[Any, Any], labels: np.ndarray[Any, Any]) -> TensorDataset:
        return TensorDataset(
            torch.tensor(images.astype(np.float32) / 255.0), torch.tensor(labels.astype(np.int64))
        )

    return (
        dataset(arrays["train_images"], arrays["train_labels"]),
        dataset(arrays["test_images"], arrays["test_labels"]),
    )


def synthetic_data(width: int, samples: int, seed: int) -> tuple[TensorDataset, TensorDataset]:
    generator = torch.Generator().manual_seed(seed + 1)
    features = torch.randn(samples, width, generator=generator)
    # Labels from a fixed random linear teacher, so the loss can fall.
    teacher = torch.randn(width, NUM_CLASSES, generator=generator)
    labels = (features @ teacher).argmax(dim=1)
    return _split(features, labels, test_fraction=0.1)


# What a workload imports only when it is built, for the in-place launcher's forkserver to import once
# (ddp_trainer.elastic): sklearn alone takes seconds.
LAZY_IMPORTS: Final[Mapping[str, tuple[str, ...]]] = {
    "digits": ("sklearn.datasets",),
    "gcn": ("ddp_trainer.training.gcn",),
}


def build_workload(config: TrainConfig) -> Workload:
    """The data and the freshly initialized model (seeded: every rank builds the same one)."""
    if config.workload == "gcn":
        # Imported here: the graph code is only loaded by the workload that needs it.
        from ddp_trainer.training.gcn import build_gcn_workload, load_graph

        graph = load_graph(config.graph_data, Path(config.data_dir), config.graph_nodes)
        gcn = build_gcn_workload(graph, config.gcn_hidden, config.gcn_layers, config.seed)
        return Workload(name=config.workload, model=gcn.model, train=gcn.train, test=gcn.test)
    if config.workload == "digits":
        train, test = digits_data()
    elif config.workload == "mnist":
        train, test = mnist_data(Path(config.data_dir), config.mnist_url)
    elif config.workload == "synthetic":
        train, test = synthetic_data(config.synthetic_width, config.synthetic_samples, config.seed)
    else:
        raise ValueError(f"unknown workload {config.workload!r}")
    torch.manual_seed(config.seed)
    sample = train.tensors[0][0]
    if config.workload == "synthetic":
        model = mlp(config.synthetic_width, config.synthetic_depth)
    else:
        model = flatten_linear(sample.numel())
    return Workload(name=config.workload, model=model, train=train, test=test)
