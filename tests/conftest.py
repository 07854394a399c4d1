import atexit
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Exports run in vLLM wherever $PRUNE_HEADS_VLLM_PYTHON names one (CI sets it): only tests/test_vllm.py asks for it,
# under another name, so no other export (in this process or a CLI subprocess) pays two vLLM engine starts.
if "PRUNE_HEADS_VLLM_PYTHON" in os.environ:
    os.environ["PRUNE_HEADS_TEST_VLLM_PYTHON"] = os.environ.pop("PRUNE_HEADS_VLLM_PYTHON")

# What prune-heads keeps between runs (a GGUF's conversion, models/gguf_cache.py) goes to one directory per test run,
# made here in the controlling process before pytest-xdist starts its workers, which inherit it: the embedded model is
# converted by its first load and read back by the others, and the user's own cache is neither read nor written.
# Removed when the controlling process exits (the workers are gone by then).
if "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["PRUNE_HEADS_CACHE_DIR"] = tempfile.mkdtemp(prefix="prune-heads-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PRUNE_HEADS_CACHE_DIR"], ignore_errors=True)

# Under pytest-xdist (pyproject's addopts: one worker per core), each worker computes on its share of the cores: N
# workers each running torch on every core would fight over them. Set before torch loads; subprocesses inherit it.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _float32_when_auto(request, monkeypatch):
    """``--dtype auto`` measures the CPU (bfloat16 where it is faster here, models/dtypes.py): in-process tests would
    then run in bf16 on some machines and float32 on others. They get float32 everywhere, as if bf16 were slow; the
    tests of the choice itself patch the measurement or are marked ``real_dtype_measurement``."""
    if request.node.get_closest_marker("real_dtype_measurement") is None:
        import prune_heads.models.dtypes as dtypes

        monkeypatch.setattr(dtypes, "cpu_matmul_speeds", lambda: (100.0, 25.0))


def pytest_configure(config):
    config.addinivalue_line("markers", "real_dtype_measurement: let --dtype auto measure this CPU")


def _cost(item) -> tuple:
    """Longest first: the embedded model's runs (by the processes each runs at once), then the other slow tests."""
    embedded = item.get_closest_marker("embedded")
    return (-(embedded.kwargs.get("processes", 1) if embedded else 0), item.get_closest_marker("slow") is None)


def pytest_collection_modifyitems(config, items):
    """The longest tests first, one per worker. pytest-xdist (pyproject's addopts: ``--maxschedchunk 1``) hands each
    worker two tests to start with and one more as each finishes: so each of the first few long tests is paired with
    a short one, and the next long test starts on another worker at once instead of queueing behind the first. The
    run ends when its longest chain does, not later."""
    items.sort(key=_cost)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        longest = [i for i in items[:workers] if _cost(i)[0] < 0]
        short = [i for i in reversed(items) if _cost(i) == (0, True)][:len(longest)]
        rest = [i for i in items if i not in longest and i not in short]
        items[:] = [x for pair in zip(longest, short) for x in pair] + rest


def _tmpfs(directory, options: str, what: str):
    """A tmpfs mounted on ``directory`` with ``options`` (root only: CI runs as root and may not skip), unmounted after."""
    directory.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
                                                   capture_output=True).returncode == 0
    if not mounted:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs as root and must be able to mount a tmpfs for {what}")
        pytest.skip("mounting a tmpfs needs root")
    yield directory
    subprocess.run(["umount", "-l", str(directory)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of 40 MiB (tmpfs): writes past it fail with ENOSPC as on a full disk."""
    yield from _tmpfs(tmp_path / "disk", "size=40m", "the full-disk tests")


@pytest.fixture
def read_only_disk(tmp_path):
    """A file system mounted read-only: nothing can be written there, by root either."""
    yield from _tmpfs(tmp_path / "read-only", "ro,size=1m", "the read-only tests")
