import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs one worker a core: one thread each, children too
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """Tiny model folder + corpus shared by the pipeline, method and compare tests."""
    from tiny import make_assets

    return make_assets(tmp_path_factory.mktemp("assets"))
