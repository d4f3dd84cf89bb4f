import os

# Eight fake CPU devices for the sharding tests; set before anything imports jax.
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import pytest  # noqa: E402

from tests.models.hf_fixtures import CHECKPOINTS, write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Every tiny HF checkpoint, written once per session: name -> directory."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: write_checkpoint(name, root / name) for name in CHECKPOINTS}
