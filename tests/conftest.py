import pytest
import torch

import sparse_dsa_ops  # noqa: F401  (registers the ops)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    """A seeded CPU generator: every test draws fresh, reproducible data."""
    return torch.Generator().manual_seed(20261129)
