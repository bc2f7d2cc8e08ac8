"""A driver's working directory shipped to the nodes: packing (limits, links, what is left
out), the node's cache (unpack checks, reuse), and groups whose code exists only there.

The two-namespace test (nodes that share no sockets with the driver) is in
tests/deploy/test_multinode.py; here an embedded cluster's agents run on this machine, which is
enough to show that the workers import the node's copy and not the driver's directory.
"""

from __future__ import annotations

import importlib
import io
import os
import sys
import textwrap
import uuid
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

import aiorl
from aiorl.runtime.working_dir import WorkingDir, pack, unpack
from tests._processes import gone_within

pytestmark = pytest.mark.timeout(120)


def write_project(root: Path, module: str, helper: str) -> Path:
    """A driver's code directory: a worker module that imports a helper that nothing
    installed provides, a data file, and what packing must leave out."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{helper}.py").write_text("GREETING = 'from the shipped helper'\n")
    (root / f"{module}.py").write_text(textwrap.dedent(f"""
        import os
        import sys

        import aiorl
        import {helper}


        class Shipped(aiorl.Worker):
            def where(self):
                here = os.environ.get("AIORL_WORKING_DIR")
                data = "data/settings.txt"
                return {{
                    "module": sys.modules[type(self).__module__].__file__,
                    "helper": {helper}.__file__,
                    "greeting": {helper}.GREETING,
                    "working_dir": here,
                    "inode": os.stat(here).st_ino if here else None,
                    "cwd": os.getcwd(),
                    "data": open(data).read() if os.path.exists(data) else None,
                    "node": self.worker_info.node_rank,
                }}
    """))
    (root / "data").mkdir(exist_ok=True)
    (root / "data" / "settings.txt").write_text("lr=0.1\n")
    (root / ".git").mkdir(exist_ok=True)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "__pycache__").mkdir(exist_ok=True)
    (root / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0" * 10)
    env = root / "myenv"  # a virtual environment under an unusual name
    env.mkdir(exist_ok=True)
    (env / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (env / "big.so").write_bytes(b"\0" * 1000)
    return root


@contextmanager
def importable(root: Path, module: str) -> Iterator[Any]:
    """Import ``module`` from ``root`` in this driver, and forget both afterwards."""
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module(module)
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if n.startswith("wd_")]:
            del sys.modules[name]


def names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"wd_worker_{tag}", f"wd_helper_{tag}"


# ---------------------------------------------------------------------------- packing


def test_pack_leaves_out_caches_vcs_and_environments_and_is_deterministic(tmp_path):
    root = write_project(tmp_path / "p", "wd_m", "wd_h")
    (root / "notes.ckpt").write_bytes(b"x" * 100)
    first = pack(WorkingDir(str(root), excludes=("*.ckpt",)))
    names_in = sorted(zipfile.ZipFile(io.BytesIO(first.data)).namelist())
    assert names_in == ["data/settings.txt", "wd_h.py", "wd_m.py"]
    assert first.files == 3 and first.size == sum(
        (root / n).stat().st_size for n in names_in)
    again = pack(WorkingDir(str(root), excludes=("*.ckpt",)))
    assert (again.digest, again.data) == (first.digest, first.data)
    (root / "wd_h.py").write_text("GREETING = 'changed'\n")
    assert pack(WorkingDir(str(root), excludes=("*.ckpt",))).digest != first.digest


def test_a_directory_over_its_limit_is_refused_naming_the_largest_entries(tmp_path):
    root = tmp_path / "p"
    (root / "checkpoints").mkdir(parents=True)
    (root / "checkpoints" / "step_100.pt").write_bytes(b"\0" * 300_000)
    (root / "train.py").write_text("print('hi')\n")
    with pytest.raises(aiorl.WorkingDirError) as e:
        pack(WorkingDir(str(root), max_bytes=100_000))
    message = str(e.value)
    assert "more than its limit of 0.1 MiB" in message
    assert "checkpoints/ (0.3 MiB)" in message
    assert "excludes=" in message and "max_bytes=" in message
    assert isinstance(e.value, ValueError)
    assert pack(WorkingDir(str(root), max_bytes=100_000, excludes=("checkpoints",))).files == 1


def test_a_symbolic_link_that_leaves_the_directory_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("password\n")
    root = tmp_path / "p"
    root.mkdir()
    (root / "inside.txt").write_text("ok\n")
    (root / "alias.txt").symlink_to(root / "inside.txt")  # inside: its content travels
    packed = pack(WorkingDir(str(root)))
    archive = zipfile.ZipFile(io.BytesIO(packed.data))
    assert archive.read("alias.txt") == b"ok\n"

    (root / "sub").mkdir()
    (root / "sub" / "leak.txt").symlink_to(secret)
    with pytest.raises(aiorl.WorkingDirError, match=r"sub/leak.txt is a symbolic link that "
                       r"points to .*secret.txt, outside the working directory"):
        pack(WorkingDir(str(root)))
    (root / "sub" / "leak.txt").unlink()
    (root / "sub" / "up").symlink_to(tmp_path)  # a directory outside
    with pytest.raises(aiorl.WorkingDirError, match="sub/up is a symbolic link"):
        pack(WorkingDir(str(root)))
    (root / "sub" / "up").unlink()
    (root / "sub" / "loop").symlink_to(root)
    with pytest.raises(aiorl.WorkingDirError, match="a loop"):
        pack(WorkingDir(str(root)))
    (root / "sub" / "loop").unlink()
    (root / "gone").symlink_to(root / "missing")
    with pytest.raises(aiorl.WorkingDirError, match="gone is a symbolic link that dangles"):
        pack(WorkingDir(str(root)))


def test_a_missing_directory_and_a_wrong_type_are_named(tmp_path):
    with pytest.raises(aiorl.WorkingDirError, match="is not a directory on this machine"):
        pack(WorkingDir(str(tmp_path / "nope")))
    with pytest.raises(TypeError, match="working_dir must be a path or an aiorl.WorkingDir"):
        WorkingDir.of(42)  # type: ignore[arg-type]


def test_unpack_checks_the_digest_and_refuses_entries_that_leave_the_directory(tmp_path):
    root = write_project(tmp_path / "p", "wd_m", "wd_h")
    packed = pack(WorkingDir(str(root)))
    cache = tmp_path / "cache"
    with pytest.raises(aiorl.WorkingDirError, match="does not match its digest"):
        unpack(packed.data + b"x", packed.digest, str(cache / packed.digest), 1 << 20)
    with pytest.raises(aiorl.WorkingDirError, match="exceed this node's limit"):
        unpack(packed.data, packed.digest, str(cache / packed.digest), 10)
    unpack(packed.data, packed.digest, str(cache / packed.digest), 1 << 20)
    assert (cache / packed.digest / "data" / "settings.txt").read_text() == "lr=0.1\n"
    unpack(packed.data, packed.digest, str(cache / packed.digest), 1 << 20)  # there already

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("../escape.py", "x = 1\n")
    hostile = buffer.getvalue()
    import hashlib

    digest = hashlib.sha256(hostile).hexdigest()
    with pytest.raises(aiorl.WorkingDirError, match="refused entry '../escape.py'"):
        unpack(hostile, digest, str(cache / digest), 1 << 20)
    assert not (tmp_path / "escape.py").exists()
    assert sorted(p.name for p in cache.iterdir()) == [packed.digest]  # no staging left


# ---------------------------------------------------------------------------- on a cluster


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_a_directory_over_the_limit_is_refused_before_anything_starts(tmp_path):
    root = tmp_path / "p"
    root.mkdir()
    (root / "weights.bin").write_bytes(b"\0" * 50_000)
    before = _children()
    with pytest.raises(aiorl.WorkingDirError, match="more than its limit"):
        aiorl.Cluster(num_nodes=1, working_dir=WorkingDir(str(root), max_bytes=10_000))
    assert _children() == before  # no registry, no agent was started


def test_workers_on_two_nodes_import_the_shipped_copy_and_a_second_job_reuses_it(tmp_path):
    module, helper = names()
    root = write_project(tmp_path / "project", module, helper)
    before = _children()  # what this test process runs already is not this cluster's
    with importable(root, module) as mod:
        with aiorl.Cluster(num_nodes=2, working_dir=WorkingDir(str(root), chdir=True)) as c:
            group = mod.Shipped.create_group().launch(
                c, aiorl.placement.NodePlacementStrategy([0, 1]), name="shipped")
            first = group.where().wait(60)
            assert [r["node"] for r in first] == [0, 1]
            for r in first:
                copy = r["working_dir"]
                assert copy and not copy.startswith(str(root)), r
                assert os.path.basename(copy) == c.working_dir.digest
                assert r["module"] == os.path.join(copy, f"{module}.py")  # by name, not value
                assert r["helper"] == os.path.join(copy, f"{helper}.py")
                assert r["greeting"] == "from the shipped helper"
                assert r["cwd"] == copy and r["data"] == "lr=0.1\n"
                assert not os.path.exists(os.path.join(copy, ".git"))
                assert not os.path.exists(os.path.join(copy, "myenv"))
            group.close()
            # A second group (a second job of this driver) finds the nodes' copies in place.
            again = mod.Shipped.create_group().launch(
                c, aiorl.placement.NodePlacementStrategy([1, 0]), name="again")
            second = again.where().wait(60)
            assert {(r["node"], r["inode"]) for r in second} == {
                (r["node"], r["inode"]) for r in first}
            # launch(working_dir=...) overrides the cluster's, here without chdir.
            other = mod.Shipped.create_group().launch(
                c, aiorl.placement.NodePlacementStrategy([0]), name="other",
                working_dir=str(root))
            [third] = other.where().wait(60)
            assert third["working_dir"] == first[0]["working_dir"]  # same files, same entry
            assert third["cwd"] != third["working_dir"] and third["data"] is None
            copies = {r["working_dir"] for r in first}
            pids = _children() - before
    assert gone_within(pids, 10)
    assert not any(os.path.exists(p) for p in copies)  # the agents removed their caches


def test_launch_refuses_a_link_out_of_the_directory_before_registering(tmp_path, cluster):
    module, helper = names()
    root = write_project(tmp_path / "project", module, helper)
    (root / "home").symlink_to(Path.home())
    with importable(root, module) as mod:
        with pytest.raises(aiorl.WorkingDirError, match="home is a symbolic link"):
            mod.Shipped.create_group().launch(cluster, name="leaky", working_dir=str(root))
        assert "leaky" not in cluster.groups


# ---------------------------------------------------------------------------- wire messages


def test_the_messages_round_trip_and_refuse_a_digest_that_is_not_one():
    from aiorl.protocol.spawn import SpawnRequest, WorkerLaunch
    from aiorl.protocol.working_dir import WorkingDirOffer, WorkingDirReply

    digest = "ab" * 32
    offer = WorkingDirOffer(digest, 10, 20)
    assert WorkingDirOffer.from_wire(offer.to_wire()) == offer
    assert WorkingDirReply.from_wire(WorkingDirReply(True).to_wire()).cached is True
    for bad in ("../../etc", "AB" * 32, digest + "0"):
        with pytest.raises(aiorl.ProtocolError, match="working_dir.digest"):
            WorkingDirOffer.from_wire({**offer.to_wire(), "digest": bad})
    request = SpawnRequest("g", "d", 1, (WorkerLaunch(0, cwd="/x"),), "m.W", None, digest, True)
    assert SpawnRequest.from_wire(request.to_wire()) == request
    plain = SpawnRequest("g", "d", 1, (WorkerLaunch(0),))
    assert "working_dir" not in plain.to_wire()
    assert SpawnRequest.from_wire(plain.to_wire()) == plain
    with pytest.raises(aiorl.ProtocolError, match="spawn.working_dir"):
        SpawnRequest.from_wire({**request.to_wire(), "working_dir": "/tmp"})


def test_the_node_cache_keeps_a_bounded_number_of_unused_entries(tmp_path):
    """Entries a killed agent left in a kept log directory are adopted as the oldest unused
    ones, its staging directories removed, and no more than KEEP_UNUSED unused entries stay
    once a new directory arrives; an entry a live group uses is never removed."""
    import asyncio

    from aiorl.node.working_dirs import KEEP_UNUSED, WorkingDirCache
    from aiorl.protocol.spawn import SpawnRequest, WorkerLaunch
    from aiorl.protocol.working_dir import WorkingDirOffer

    root = tmp_path / "working_dirs"
    old = [f"{i:064x}" for i in range(KEEP_UNUSED + 2)]
    for digest in old:
        (root / digest).mkdir(parents=True)
    (root / ".unpack-abc").mkdir()
    live: set[str] = set()
    cache = WorkingDirCache(str(root), lambda: live)
    packed = pack(WorkingDir(str(write_project(tmp_path / "p", "wd_m", "wd_h"))))
    request = SpawnRequest("busy", "d", 1, (WorkerLaunch(0),), working_dir=old[0])
    prepared = cache.prepare(request)  # a live group holds the oldest leftover
    assert prepared.workers[0].env["PYTHONPATH"].split(os.pathsep)[0] == str(root / old[0])
    live.add("busy")

    offer = WorkingDirOffer(packed.digest, len(packed.data), packed.size)
    asyncio.run(cache._receive(offer, packed.data))
    kept = sorted(p.name for p in root.iterdir())
    assert packed.digest in kept and old[0] in kept and ".unpack-abc" not in kept
    assert len(kept) == KEEP_UNUSED + 1  # the unused ones, plus the one in use
    with pytest.raises(aiorl.WorkingDirError, match="is not on this node"):
        cache.prepare(SpawnRequest("g", "d", 1, (WorkerLaunch(0),), working_dir="f" * 64))
    cache.close()
    assert not root.exists()
