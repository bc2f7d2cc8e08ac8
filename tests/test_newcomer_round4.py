"""A newcomer's fourth round: what got in the way of a new user porting a Ray program and
writing an RL pipeline from the docs alone.

Each test drives real processes (a driver script, an embedded cluster, the CLI), because the
failures were in what starts where: the directory a driver runs in, a port nobody listens on,
a consumer killed mid-run.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from aiorl.util.processes import python_module_command

pytestmark = pytest.mark.timeout(120)

_BASE_MODULE = textwrap.dedent("""\
    import aiorl

    class Base(aiorl.Worker):
        def hello(self):
            return "base"
""")

_DRIVER = textwrap.dedent("""\
    import aiorl
    from r4_base import Base

    class Child(Base):
        def where(self):
            import aiorl
            return aiorl.__file__, self.hello()

    if __name__ == "__main__":
        with aiorl.Cluster(num_nodes=1) as cluster:
            group = Child.create_group().launch(cluster, num_workers=1, name="child")
            print("RESULT", *group.where().wait(60)[0], flush=True)
""")


def test_a_folder_named_aiorl_in_the_working_directory_does_not_replace_the_package(tmp_path):
    """Run from a directory holding an ``aiorl/`` folder (the clone's parent directory, or
    any empty one), every rank used to fail with "module 'aiorl' has no attribute
    'Worker'": ``python -m`` put that directory first in the agent, the zygote and so every
    worker, and the folder became the ``aiorl`` package."""
    scripts, cwd = tmp_path / "scripts", tmp_path / "cwd"
    (cwd / "aiorl").mkdir(parents=True)
    scripts.mkdir()
    (scripts / "r4_base.py").write_text(_BASE_MODULE)
    (scripts / "driver.py").write_text(_DRIVER)
    out = subprocess.run([sys.executable, str(scripts / "driver.py")], cwd=cwd,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    import aiorl
    assert f"RESULT {aiorl.__file__} base" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize("interpreter", ["ours", "another"])
def test_a_module_command_leaves_the_working_directory_out_then_last(tmp_path, interpreter):
    """Both spellings (``-P`` for this interpreter, ``-c`` code for one that may be older)
    import the installed package, not a folder of its name in the working directory."""
    site, cwd = tmp_path / "site", tmp_path / "cwd"
    (cwd / "aiorl").mkdir(parents=True)
    site.mkdir()
    (site / "r4_probe.py").write_text(
        "import sys, aiorl\n"
        "from aiorl.node.zygote import working_directory_last\n"
        "working_directory_last()\n"
        "print(aiorl.__file__, sys.path[-1], sys.argv[1:])\n")
    python = None
    if interpreter == "another":  # a wrapper: a path that is not this interpreter's
        python = str(tmp_path / "python-wrapper")
        pathlib.Path(python).write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
        os.chmod(python, 0o755)
    command = python_module_command("r4_probe", "x", "y", interpreter=python)
    assert ("-P" in command) == (interpreter == "ours" and sys.version_info >= (3, 11))
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    import aiorl
    assert out.stdout.split() == [aiorl.__file__, str(cwd), "['x',", "'y']"]
