import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """Tiny model folder + corpus shared by the pipeline, method and compare tests."""
    from tiny import make_assets

    return make_assets(tmp_path_factory.mktemp("assets"))
