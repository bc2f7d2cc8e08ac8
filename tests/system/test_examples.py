"""Every example runs, and the examples index (docs/examples.md) lists every example.

The examples run as users run them (``python examples/x.py``), each as its own driver process,
attached to one registry and node agent that this module starts on loopback, as on a real
cluster (``AIORL_REGISTRY`` + ``AIORL_KEY_FILE``, docs/deploy.md): the node's zygote stays
warm between examples, so each takes seconds instead of a cold start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests._paths import REPO_ROOT

ROOT = REPO_ROOT
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
#: A line each example prints when it worked.
EXPECTED = {
    "load_balancing.py": "4 rollouts produced",
    "pipeline.py": "accuracy: ",
    "quickstart.py": "10 concurrent fan-out calls: 10 results",
}

pytestmark = pytest.mark.timeout(120)


def test_every_example_is_indexed_and_checked() -> None:
    index = (ROOT / "docs" / "examples.md").read_text()
    assert sorted(EXPECTED) == EXAMPLES
    missing = [name for name in EXAMPLES if f"examples/{name}" not in index]
    assert not missing, f"docs/examples.md does not list {missing}"


@pytest.fixture(scope="module")
def cluster_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    key = tmp_path_factory.mktemp("cluster") / "cluster.key"
    registry = subprocess.Popen(
        [sys.executable, "-m", "aiorl.registry.service", "--host", "127.0.0.1", "--port", "0",
         "--print-address", "--key-file", str(key), "--exit-on-stdin-close",
         "--log-level", "WARNING"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    children = [registry]
    try:
        assert registry.stdout is not None
        address = registry.stdout.readline().decode().strip().split("=", 1)[1]
        children.append(subprocess.Popen(
            [sys.executable, "-m", "aiorl.node.agent", "--registry", address, "--host",
             "127.0.0.1", "--key-file", str(key), "--accelerators", "4",
             "--exit-on-stdin-close", "--log-level", "WARNING"],
            stdin=subprocess.PIPE))
        yield {**os.environ, "AIORL_REGISTRY": address, "AIORL_KEY_FILE": str(key)}
    finally:
        for child in reversed(children):
            child.terminate()
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            for stream in (child.stdin, child.stdout):
                if stream:
                    stream.close()


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name: str, cluster_env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name)], env=cluster_env,
                          cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert EXPECTED[name] in done.stdout, done.stdout[-2000:]
