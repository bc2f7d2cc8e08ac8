"""A remote traceback shows the user's file and failing line, whatever cloudpickle's version.

cloudpickle 3.1.3 renames the file of code it pickles by value to ``"<dynamic-code>"``; aiorl
carries code objects whole and the source beside them (aiorl.transport.code). Each test runs a
real driver script in its own process, so its worker class lives in ``__main__`` and travels by
value, as a user's would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(240)

SCRIPT = textwrap.dedent('''\
    import cloudpickle

    import aiorl

    API_TOKEN = "tok-0123456789abcdef"  # the class never uses it: it must not travel


    class Scorer(aiorl.Worker):
        def score(self, x):
            return self.check(x)

        def check(self, x):
            raise ValueError(f"no score for {x}")  # the failing line

        def driver_text_here(self):
            """Whether this worker's linecache holds the script's unused constant (looked up
            without loading: a script on this machine's disk is read only for a traceback)."""
            import linecache
            entry = linecache.cache.get(self.check.__code__.co_filename)
            token = "tok-" + "0123456789abcdef"  # this line's text is not the token's
            return token in "".join(entry[2] if entry else [])


    if __name__ == "__main__":
        print("cloudpickle", cloudpickle.__version__, flush=True)
        with aiorl.Cluster(num_nodes=1) as cluster:
            group = Scorer.create_group().launch(cluster, num_workers=1, name="scorer")
            print("driver text in the worker", group.driver_text_here().wait(60)[0], flush=True)
            try:
                group.score(7).wait(60)
            except aiorl.RemoteError as exc:
                print(exc, flush=True)
    ''')


def _run_driver(args: list[str], env_extra: dict[str, str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "AIORL_REGISTRY"}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _assert_names_the_users_code(output: str, filename: str) -> None:
    failing = SCRIPT.splitlines().index(
        '        raise ValueError(f"no score for {x}")  # the failing line') + 1
    assert "<dynamic-code>" not in output
    assert f'File "{filename}", line {failing}, in check' in output, output
    assert 'raise ValueError(f"no score for {x}")  # the failing line' in output, output
    assert f'File "{filename}", line {failing - 3}, in score' in output, output
    assert "ValueError: no score for 7" in output, output
    # Only the lines of the class's code travel: not the script's constant the class never uses.
    assert "driver text in the worker False" in output, output


@pytest.fixture(scope="module")
def newest_cloudpickle(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The newest cloudpickle release on the package index, installed apart from the lock."""
    target = tmp_path_factory.mktemp("newest-cloudpickle")
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade",
                        "--timeout", "20", "--target", str(target), "cloudpickle"],
                       check=True, capture_output=True, text=True, timeout=120)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"the package index is out of reach, the newest cloudpickle too: {exc}")
    return str(target)


def test_a_script_workers_traceback_names_the_script_and_its_line(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    output = _run_driver([str(script)])
    _assert_names_the_users_code(output, str(script))


def test_the_same_under_the_newest_cloudpickle(tmp_path, newest_cloudpickle) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    path = os.pathsep.join(filter(None, [newest_cloudpickle, os.environ.get("PYTHONPATH")]))
    output = _run_driver([str(script)], {"PYTHONPATH": path})
    installed = next(d for d in os.listdir(newest_cloudpickle) if d.endswith(".dist-info"))
    version = installed.removeprefix("cloudpickle-").removesuffix(".dist-info")
    assert f"cloudpickle {version}" in output  # the driver and its workers ran that release
    _assert_names_the_users_code(output, str(script))


def test_code_from_a_file_no_worker_can_read_shows_its_source_line() -> None:
    """A notebook cell, or a script that is not on the worker's node: IPython registers a cell's
    source in linecache under a name that is no file; the workers get the text from the driver."""
    cell = "<notebook-cell-3>"
    driver = textwrap.dedent(f'''\
        import linecache, sys
        source = sys.stdin.read()
        linecache.cache[{cell!r}] = (len(source), None, source.splitlines(True), {cell!r})
        exec(compile(source, {cell!r}, "exec"), {{"__name__": "__main__"}})
        ''')
    env = {k: v for k, v in os.environ.items() if k != "AIORL_REGISTRY"}
    out = subprocess.run([sys.executable, "-c", driver], input=SCRIPT, env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    _assert_names_the_users_code(out.stdout, cell)


def test_only_the_lines_of_the_shipped_code_travel() -> None:
    """What `dumps_with_sources` carries of a script: the lines of the pickled code (from each
    function's decorators to its end, nested functions included), every other line blank."""
    import linecache
    import pickle

    from aiorl.transport.code import dumps_with_sources, loads_with_sources

    source = SCRIPT + textwrap.dedent('''\

        def deco(f):
            return f


        class Other:
            @deco
            def outer(self):
                def inner():
                    return 1
                return inner()
        ''')
    filename = "/nonexistent/driver_script.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        namespace = {"__name__": "__main__"}
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - the test's own text
        data = dumps_with_sources(namespace["Other"])
    finally:
        del linecache.cache[filename]
    _inner, sources = pickle.loads(data)
    lines = source.splitlines(True)
    first = lines.index("    @deco\n") + 1
    carried = sources[filename].splitlines(True)
    assert carried[first - 1:] == lines[first - 1:first + 5]  # @deco .. return inner()
    assert all(line == "\n" for line in carried[:first - 1])
    assert b"tok-0123456789abcdef" not in data and b"API_TOKEN" not in data
    assert loads_with_sources(data)().outer() == 1
    assert linecache.getlines(filename)[first] == "    def outer(self):\n"
    del linecache.cache[filename]
