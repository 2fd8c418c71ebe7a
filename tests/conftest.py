import pytest
import torch

import sparse_dsa_ops  # noqa: F401  (registers the ops)

# The CPU tests are many small ops, where torch's intra-op threads cost more than they give; CI runs this suite
# beside the lowering sweep on two cores, where extra threads only contend
torch.set_num_threads(1)


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
