import pytest

from tests.models.hf_fixtures import CHECKPOINTS, write_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Every tiny HF checkpoint, written once per session: name -> directory."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: write_checkpoint(name, root / name) for name in CHECKPOINTS}
