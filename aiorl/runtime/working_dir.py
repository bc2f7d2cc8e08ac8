"""A driver's working directory, packed to travel to nodes that do not share its filesystem.

Ray's ``runtime_env={"working_dir": ...}`` and RLinf's ``RLINF_CODE_WORKING_DIR`` in aiorl:
the driver names a directory (``Cluster(working_dir=...)`` or ``launch(working_dir=...)``);
it is packed once per driver into one deterministic zip held in memory, and every node agent
that starts a worker of the driver's groups receives it once, unpacks it into a cache keyed
by the zip's SHA-256 and puts it first on the workers' ``sys.path`` (and, with
``chdir=True``, makes it their current directory). A module imported from there in the
driver is then imported by name in the workers, from the node's copy.

Packing refuses, before anything is sent or started:

* a directory over ``max_bytes`` (the message names the largest entries and how to leave
  them out): a checkpoint or a data set left in the code directory would otherwise be
  copied to every node;
* a symbolic link that leaves the directory (or dangles): what it points to is not part of
  the code, and following it could ship a user's private files. Links inside the directory
  are followed (the file's content travels under the link's name).

Left out: version-control and cache directories, virtual environments (any directory
holding ``pyvenv.cfg`` or ``conda-meta``, whatever its name), compiled bytecode, and what
``excludes`` names; sockets, pipes and devices are not files and are skipped. Unpacking
checks the digest and every entry's name (no absolute path, no ``..``) and size, so a
damaged or hostile archive cannot write outside its cache entry.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import os
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from aiorl.errors import WorkingDirError

__all__ = [
    "DEFAULT_EXCLUDES", "DEFAULT_MAX_BYTES", "PackedDir", "WorkingDir", "pack", "unpack",
]

#: The default bound on the files' total size: code and small configs, not data sets.
DEFAULT_MAX_BYTES = 100 << 20

#: Names (of a file or directory, or of its path relative to the working directory) left
#: out of every pack: version control, caches, bytecode, virtual environments by their
#: usual names (others are recognised by their ``pyvenv.cfg``).
DEFAULT_EXCLUDES = (
    ".git", ".hg", ".svn", "__pycache__", "*.pyc", "*.pyo", ".venv", "venv", ".tox", ".nox",
    ".mypy_cache", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", "node_modules",
    "*.egg-info", ".DS_Store",
)

#: A fixed timestamp for every entry: the same files give the same zip, hence the same digest.
_EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class WorkingDir:
    """What to ship: a directory and how.

    Args:
        path: The directory (``~`` is expanded).
        excludes: More names to leave out, as shell patterns matched against each entry's
            name and its path relative to ``path`` (``"data"``, ``"*.ckpt"``,
            ``"logs/*"``); added to `DEFAULT_EXCLUDES`.
        max_bytes: The largest total size of the files shipped (100 MiB by default).
        chdir: Also make the node's copy the workers' current directory (relative paths in
            the code then resolve as on the driver).

    Example:
        ```python
        code = aiorl.WorkingDir("~/project", excludes=["data", "*.ckpt"], chdir=True)
        cluster = aiorl.Cluster(registry="tcp://head:6380", working_dir=code)
        ```
    """

    path: str
    excludes: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_BYTES
    chdir: bool = False

    @classmethod
    def of(cls, value: WorkingDir | str | os.PathLike[str]) -> WorkingDir:
        """``value`` as a `WorkingDir` (a path gets the defaults)."""
        if isinstance(value, WorkingDir):
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls(os.fspath(value))
        raise TypeError(f"working_dir must be a path or an aiorl.WorkingDir, got "
                        f"{type(value).__name__}")


@dataclass(frozen=True)
class PackedDir:
    """A packed working directory: the zip, its digest, and what it holds."""

    source: str  #: the directory's real path on the driver
    digest: str  #: SHA-256 of ``data``, hex: the node's cache key
    data: bytes
    files: int
    size: int  #: the files' total size, unpacked
    chdir: bool

    def contains(self, path: str | None) -> bool:
        """Whether ``path`` (a module's file, say) lies inside the packed directory."""
        if not path:
            return False
        real = os.path.realpath(path)
        return real == self.source or real.startswith(self.source + os.sep)


def _excluded(name: str, rel: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(rel, p) for p in patterns)


def _is_environment(path: str) -> bool:
    return os.path.exists(os.path.join(path, "pyvenv.cfg")) or os.path.isdir(
        os.path.join(path, "conda-meta"))


def _inside(root: str, real: str) -> bool:
    return real == root or real.startswith(root + os.sep)


def _files(root: str, patterns: tuple[str, ...]) -> Iterator[tuple[str, str, int, int]]:
    """(relative posix path, real path, size, mode) of every file to ship, sorted."""

    def walk(real_dir: str, rel_dir: str, chain: tuple[str, ...]) -> Iterator[
            tuple[str, str, int, int]]:
        for name in sorted(os.listdir(real_dir)):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            path = os.path.join(real_dir, name)
            if _excluded(name, rel, patterns):
                continue
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                target = os.path.realpath(path)
                if not _inside(root, target) or not os.path.exists(target):
                    what = ("dangles" if not os.path.exists(target)
                            else f"points to {target}, outside the working directory")
                    raise WorkingDirError(
                        f"working directory {root}: {rel} is a symbolic link that {what}; "
                        f"nodes would not have what it names. Copy the file in, remove the "
                        f"link, or leave it out with WorkingDir(..., excludes=[{rel!r}])")
                st = os.stat(target)
                path = target
            if stat.S_ISDIR(st.st_mode):
                real = os.path.realpath(path)
                if real in chain:
                    raise WorkingDirError(
                        f"working directory {root}: {rel} is a symbolic link to a directory "
                        f"above it (a loop); remove it or leave it out with "
                        f"WorkingDir(..., excludes=[{rel!r}])")
                if _is_environment(real):
                    continue  # a virtual environment, whatever its name
                yield from walk(real, rel, (*chain, real))
            elif stat.S_ISREG(st.st_mode):
                yield rel, path, st.st_size, st.st_mode
            # sockets, pipes, devices: not files, nothing to ship

    yield from walk(root, "", (root,))


def _largest(entries: list[tuple[str, str, int, int]], n: int = 3) -> str:
    by_top: dict[str, int] = {}
    for rel, _, size, _ in entries:
        top = rel.split("/", 1)[0] + ("/" if "/" in rel else "")
        by_top[top] = by_top.get(top, 0) + size
    biggest = sorted(by_top.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{name} ({_mib(size)})" for name, size in biggest)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def pack(spec: WorkingDir) -> PackedDir:
    """Pack ``spec``'s directory into a deterministic zip (same files, same digest).

    Raises:
        WorkingDirError: The directory is missing, holds more than ``spec.max_bytes``, or
            holds a symbolic link that leaves it (or dangles, or loops).
    """
    root = os.path.realpath(os.path.expanduser(spec.path))
    if not os.path.isdir(root):
        raise WorkingDirError(f"working directory {spec.path!r} is not a directory on this "
                              "machine; name the directory that holds the workers' code")
    if spec.max_bytes <= 0:
        raise WorkingDirError(f"WorkingDir.max_bytes must be positive, got {spec.max_bytes}")
    patterns = (*DEFAULT_EXCLUDES, *spec.excludes)
    entries = list(_files(root, patterns))
    total = sum(size for _, _, size, _ in entries)
    if total > spec.max_bytes:
        raise WorkingDirError(
            f"working directory {root} holds {_mib(total)} of files, more than its limit of "
            f"{_mib(spec.max_bytes)}; the largest entries: {_largest(entries)}. Leave data "
            f"out with WorkingDir(path, excludes=['name', ...]) (nodes read data from shared "
            f"storage), or raise WorkingDir(path, max_bytes=...)")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        for rel, path, _, mode in entries:
            info = zipfile.ZipInfo(rel, date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = ((0o755 if mode & 0o111 else 0o644) | stat.S_IFREG) << 16
            with open(path, "rb") as f:
                zf.writestr(info, f.read())
    data = buffer.getvalue()
    return PackedDir(root, hashlib.sha256(data).hexdigest(), data, len(entries), total,
                     spec.chdir)


def unpack(data: bytes, digest: str, destination: str, max_bytes: int) -> None:
    """Check ``data`` against ``digest`` and unpack it as directory ``destination``.

    The files appear all at once (unpacked beside it, then renamed), so a reader never sees
    half a directory; a ``destination`` that exists already (another request unpacked the
    same digest first) is left as it is.

    Raises:
        WorkingDirError: The digest does not match, an entry's name leaves the directory,
            or the files add up to more than ``max_bytes``.
    """
    if hashlib.sha256(data).hexdigest() != digest:
        raise WorkingDirError(f"working directory {digest[:12]}: the archive received does "
                              "not match its digest (damaged in transit); launch again")
    parent = os.path.dirname(destination)
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise WorkingDirError(f"working directory {digest[:12]}: not a zip archive ({exc})"
                              ) from None
    with zf:
        infos = zf.infolist()
        if sum(i.file_size for i in infos) > max_bytes:
            raise WorkingDirError(f"working directory {digest[:12]}: its files exceed this "
                                  f"node's limit of {_mib(max_bytes)}")
        for info in infos:
            parts = info.filename.split("/")
            if (info.filename.startswith("/") or "\\" in info.filename or info.is_dir()
                    or any(p in ("", ".", "..") for p in parts)):
                raise WorkingDirError(f"working directory {digest[:12]}: refused entry "
                                      f"{info.filename!r} (it would leave the directory)")
        os.makedirs(parent, mode=0o700, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".unpack-", dir=parent)
        try:
            for info in infos:
                target = os.path.join(staging, *info.filename.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                mode = 0o755 if (info.external_attr >> 16) & 0o111 else 0o644
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
                with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                    shutil.copyfileobj(src, out)
            os.chmod(staging, 0o755)
            try:
                os.rename(staging, destination)
            except OSError:
                if not os.path.isdir(destination):
                    raise
                shutil.rmtree(staging, ignore_errors=True)  # unpacked by someone else first
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
