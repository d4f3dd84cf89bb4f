import os

# Eight fake CPU devices for the sharding tests; set before anything imports jax.
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

# One XLA compilation cache for the session, shared by the xdist workers and the commands the
# tests start (they inherit the environment): the suite builds many identical programs (each
# trainer, engine and sampler jits its own closures), and a cache hit skips XLA's compile, a
# third of a trainer test's time. Fresh per session: every run measures what a clean clone does.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mmgrpo-tests-xla-")
    os.environ["MMGRPO_TESTS_OWN_XLA_CACHE"] = "1"  # this process made it: it removes it
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

# Tests never download: the hub is off for the session (a hub read fails at once, not after a
# minute of retries), and the paper's datasets come from a local copy when there is one.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# A shell starts a background job with SIGINT ignored (`make test &`), and an ignored signal
# stays ignored for Python and for every command a test starts: the signal tests would see
# nothing. Ctrl-C as an interactive run has it, whatever started the suite.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402

from tests.paper_data import ENV_VAR, LOCAL_DATA  # noqa: E402

if LOCAL_DATA is not None:
    os.environ[ENV_VAR] = str(LOCAL_DATA)

from tests.models.hf_fixtures import CHECKPOINTS, write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Every tiny HF checkpoint, written once per session: name -> directory."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: write_checkpoint(name, root / name) for name in CHECKPOINTS}


def pytest_unconfigure(config):
    """The session's compilation cache goes with the process that made it (the controller)."""
    if os.environ.get("MMGRPO_TESTS_OWN_XLA_CACHE") and not hasattr(config, "workerinput"):
        import shutil

        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
