"""``Cluster``: the driver's handle on a set of nodes.

Embedded mode (no registry address anywhere): start a registry and
``num_nodes`` node agents as child processes on loopback, owned by this
``Cluster`` and stopped by [`Cluster.close`][aiorl.Cluster.close] with every worker they
spawned; if that registry dies, the Cluster closes itself. Attach mode
(``registry=`` or Ray's ``address=``, ``$AIORL_REGISTRY`` or
``cluster_cfg.cluster.registry``): join a running registry and wait until
``num_nodes`` agents have joined.

A closed Cluster refuses everything at once with [`ClusterClosedError`][aiorl.ClusterClosedError].

Either way the driver registers itself and sends heartbeats; if it dies, the
registry tears down the groups it launched.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import weakref
from typing import Any

from aiorl.actors.inspection import serve_inspection
from aiorl.cluster import doctor as _doctor
from aiorl.cluster.driver import DriverSession
from aiorl.cluster.embedded import EmbeddedProcesses
from aiorl.errors import AddressError, ClusterClosedError
from aiorl.placement import ClusterSpec
from aiorl.protocol.registry import GroupSpec
from aiorl.runtime import Runtime
from aiorl.runtime.working_dir import PackedDir, WorkingDir
from aiorl.runtime.working_dir import pack as pack_working_dir
from aiorl.trace import recorder as _trace
from aiorl.transport import security
from aiorl.transport.address import normalize_address
from aiorl.transport.sockets import local_ip
from aiorl.util.threads import RuntimeThread

__all__ = ["Cluster"]

log = logging.getLogger("aiorl.cluster")

_live_clusters: weakref.WeakSet[Cluster] = weakref.WeakSet()


def _close_all_at_exit() -> None:
    for cluster in list(_live_clusters):
        try:
            cluster.close()
        except Exception:
            pass


atexit.register(_close_all_at_exit)

#: What operations on a Cluster closed by its user raise (ClusterClosedError).
CLOSED = ("this Cluster is closed (close() or the end of its `with` block stopped it); "
          "create a new aiorl.Cluster()")



def _driver_host(registry: str) -> str | None:
    """Where an attaching driver binds its endpoint: workers send it their output lines and
    the doctor probes it, so it must be reachable from their hosts. A registry on loopback
    (or a Unix socket) means one machine, and the default (127.0.0.1) stays; otherwise this
    host's address as other hosts see it (``AIORL_NODE_IP``, else the hostname's)."""
    if registry.startswith("ipc://"):
        return None
    host = registry.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost" or host.startswith("127.") or host == "::1":
        return None
    return local_ip()

class Cluster:
    """The driver's handle on a set of nodes: what groups and channels are launched into.

    Without a registry address (no ``registry=``, no ``$AIORL_REGISTRY``, none in
    ``cluster_cfg``) it is **embedded**: a registry and ``num_nodes`` node agents start as
    child processes on this machine and stop with [`close`][aiorl.Cluster.close], or when this
    process dies however it dies. With an address it **attaches** to a running registry and waits up
    to ``timeout`` seconds until ``num_nodes`` agents have joined. An embedded cluster is
    announced to ``aiorl status`` through a per-user runtime file. If an embedded cluster's
    registry dies, the Cluster closes itself (its agents stop the workers): pending work
    fails with ``PeerLostError`` and later operations raise ``ClusterClosedError``, both
    naming the reason.

    A Cluster is a `DriverSession` (this driver's registration, runtime and
    node list) plus, in embedded mode, the `EmbeddedProcesses` it started.

    Args:
        cluster_cfg: an omegaconf ``DictConfig`` or dict shaped like RLinf's ``cluster:``
            section (``num_nodes``, ``node_groups``, ``component_placement``, ``registry``).
        registry: the registry's address: ``tcp://HOST:PORT``, ``HOST:PORT`` (the same) or
            ``ipc://PATH``; anything else raises [`AddressError`][aiorl.AddressError] (a
            ``ValueError``) showing these forms.
        address: Ray's name for ``registry`` (``ray.init(address=...)``); giving both with
            different values raises [`AddressError`][aiorl.AddressError].
        num_nodes: node agents to start (embedded) or wait for (attached); default 1.
        accelerators_per_node: embedded only: declare this many accelerators per node, so
            placement and ``CUDA_VISIBLE_DEVICES`` can be tried on a machine without GPUs.
        key_file: attached only: the cluster's key file (default ``$AIORL_KEY_FILE``, then
            ``~/.aiorl/cluster.key``).
        log_to_driver: print workers' output here, each line prefixed with the worker's name.
        trace: record spans in this driver and every worker it launches (as ``AIORL_TRACE=1``
            does); [`trace_dump`][aiorl.Cluster.trace_dump] writes them as one Perfetto trace
            (docs/debugging.md). RLinf's ``cluster.tracer.enable: true`` in ``cluster_cfg``
            does the same, and ``cluster.tracer.output_file`` has ``close`` write the trace
            there.
        timeout: seconds to wait for the registry and the agents.
        working_dir: a directory (or an [`aiorl.WorkingDir`][aiorl.WorkingDir] with
            ``excludes``, ``max_bytes``, ``chdir``) holding the workers' code, for nodes that
            do not share this machine's filesystem (Ray's ``runtime_env={"working_dir":
            ...}``): packed once, here, before anything starts, and shipped to every node
            that starts a worker of this driver's groups, first on the workers' ``sys.path``
            (docs/deploy.md). ``launch(working_dir=...)`` overrides it for one group.

    Example:
        ```python
        with aiorl.Cluster() as cluster:                       # embedded, one node
            group = Rollout.create_group().launch(cluster, num_workers=4)

        cluster = aiorl.Cluster(registry="tcp://head:6380", num_nodes=2,
                                key_file="~/.aiorl/cluster.key")   # attached
        cluster = aiorl.Cluster(address="head:6380")   # the same registry, Ray's spelling

        async with aiorl.Cluster(accelerators_per_node=8) as cluster:
            ...
        ```
    """

    def __init__(
        self,
        cluster_cfg: Any = None,
        *,
        registry: str | None = None,
        address: str | None = None,
        num_nodes: int | None = None,
        accelerators_per_node: int | None = None,
        key_file: str | None = None,
        log_to_driver: bool = True,
        timeout: float = 60.0,
        trace: bool = False,
        working_dir: WorkingDir | str | os.PathLike[str] | None = None,
    ) -> None:
        # Packed first: a directory over its limit or with a link out of it is refused
        # before any process starts.
        self._working_dir = pack_working_dir(WorkingDir.of(working_dir)) if (
            working_dir is not None) else None
        self._cfg = _cluster_section(cluster_cfg)
        tracer_on, self._trace_output = _tracer_section(self._cfg)
        trace = trace or tracer_on
        self._closed = False
        self._closed_reason = CLOSED
        self._close_lock = threading.Lock()
        self._stop_tracing_on_close = False
        self._embedded: EmbeddedProcesses | None = None
        self._session: DriverSession | None = None
        address = _registry_address(registry, address, self._cfg)
        wanted = int(num_nodes if num_nodes is not None else self._cfg.get("num_nodes") or 1)
        self.embedded = not address
        if accelerators_per_node is None:
            accelerators_per_node = self._cfg.get("accelerators_per_node")
        try:
            host = None
            if self.embedded:
                self._embedded = EmbeddedProcesses(
                    wanted, accelerators_per_node, os.environ.get(security.ENV_INSECURE) == "1")
                address, keys = self._embedded.registry_address, self._embedded.keys
                host = self._embedded.ipc_location
            else:
                keys = security.ClusterKeys.load(key_file) if key_file else (
                    security.keys_from_environment())
                host = _driver_host(str(address))
            _live_clusters.add(self)
            self._session = DriverSession(str(address), keys, self._cfg, host=host,
                                          log_to_driver=log_to_driver, timeout=timeout)
            self._session.wait_for_nodes(
                wanted, timeout, self._embedded.check_alive if self._embedded else None)
            _trace.set_process_name("driver")
            if trace:
                if not _trace.ON:  # this Cluster turns it on, so its close turns it off
                    self._stop_tracing_on_close = True
                    _trace.enable()
            else:
                _trace.enable_from_environment()  # AIORL_TRACE=1
            serve_inspection(self._session.runtime)  # aiorl doctor / trace from anywhere
            if self._embedded is not None:
                me = weakref.ref(self)
                self._embedded.on_registry_exit(self._session.runtime, lambda: _registry_died(me))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the session
    @property
    def session(self) -> DriverSession:
        """This driver's registration; raises [`ClusterClosedError`][aiorl.ClusterClosedError] (a
        ``RuntimeError``) at once on a closed Cluster."""
        if self._closed:
            raise ClusterClosedError(self._closed_reason)
        if self._session is None:
            raise RuntimeError("this Cluster is not connected (it failed to start)")
        return self._session

    @property
    def closed(self) -> bool:
        """Whether the Cluster is closed ([`close`][aiorl.Cluster.close] ran, or its embedded
        registry died); a closed Cluster launches, calls and queues nothing
        (``ClusterClosedError``)."""
        return self._closed

    @property
    def runtime(self) -> Runtime:
        """This driver's runtime: its event loop thread, endpoint and registry client."""
        return self.session.runtime

    @property
    def registry_address(self) -> str:
        """The registry's address (``ipc://...`` for an embedded cluster)."""
        return self.session.registry_address

    @property
    def driver_id(self) -> str:
        """This driver's id at the registry; its groups are torn down when it goes."""
        return self.session.driver_id

    @property
    def groups(self) -> dict[str, GroupSpec]:
        """Groups this driver launched and has not closed (restored if the registry restarts).

        Empty once the Cluster is closed (a group closed after its cluster finds nothing to
        forget)."""
        return self._session.groups if self._session is not None and not self._closed else {}

    @property
    def working_dir(self) -> PackedDir | None:
        """The packed ``working_dir`` given to the constructor, shipped with every group this
        driver launches (unless ``launch(working_dir=...)`` names another); None without."""
        return self._working_dir

    @property
    def log_to_driver(self) -> bool:
        """Whether workers' output is printed here, each line prefixed with the worker's name."""
        return self.session.log_to_driver

    @property
    def keys(self) -> security.ClusterKeys | None:
        """The cluster credentials this driver uses (None when running ``--insecure``)."""
        return self.session.keys

    @property
    def session_dir(self) -> str | None:
        """The embedded cluster's private directory (sockets, key, worker logs), else None."""
        return self._embedded.session_dir if self._embedded else None

    # ------------------------------------------------------------------ inventory
    def _node_list(self) -> list[dict[str, Any]]:
        return self.session._node_list()

    @property
    def nodes(self) -> list[dict[str, Any]]:
        """Live nodes, ordered by node rank (id, ip, hostname, cpus, accelerators, ...)."""
        return self._node_list()

    @property
    def num_nodes(self) -> int:
        """The number of live nodes."""
        return len(self._node_list())

    @property
    def num_accelerators(self) -> int:
        """Accelerators over all live nodes (detected GPUs, or declared ones)."""
        return sum(int(n.get("num_accelerators", 0)) for n in self._node_list())

    @property
    def spec(self) -> ClusterSpec:
        """A [`ClusterSpec`][aiorl.placement.ClusterSpec] of the live nodes (and configured node
        groups)."""
        return self.session.spec

    # ------------------------------------------------------------------ observability
    def doctor(self, interval: float = 0.0, timeout: float = _doctor.DEFAULT_TIMEOUT
               ) -> _doctor.DoctorReport:
        """Snapshot every live process of the cluster and explain who waits on whom.

        With ``interval`` > 0 the channels are sampled again after that many seconds, to
        report channels that only grow. See docs/debugging.md.
        """
        runtime = self.runtime

        async def run() -> _doctor.DoctorReport:
            probes, status = await _doctor.collect(runtime.endpoint, runtime.registry,
                                                  "snapshot", timeout)
            later = None
            if interval > 0:
                await asyncio.sleep(interval)
                later, _ = await _doctor.collect(runtime.endpoint, runtime.registry,
                                                "snapshot", timeout)
            return _doctor.diagnose(probes, status, later, interval)

        return runtime.run_sync(run(), timeout=2 * timeout + interval + 10)

    def trace_dump(self, path: str, timeout: float = _doctor.DEFAULT_TIMEOUT) -> dict[str, Any]:
        """Pull every process's trace buffer and write one Chrome/Perfetto trace to ``path``.

        The buffers are pulled in pages and written as they arrive, so the driver holds a
        few MB whatever they hold. Returns what was written: ``{"path", "processes",
        "spans", "events"}``; open the file in ui.perfetto.dev (``json.load`` reads it).
        ``timeout`` bounds each process's answer to each page.
        """
        runtime = self.runtime
        summary, _ = runtime.run_sync(_doctor.dump_trace(runtime.endpoint, runtime.registry,
                                                         path, timeout))
        return summary

    def _write_trace(self, path: str) -> None:
        """``cluster.tracer.output_file``: the whole trace, written while the workers still
        answer; a failure is logged, never raised (closing must go on)."""
        try:
            summary = self.trace_dump(path)
            log.info("trace of %d process(es) written to %s (cluster.tracer.output_file)",
                     summary.get("processes", 0), path)
        except Exception as exc:  # noqa: BLE001 - the close goes on whatever the dump did
            log.warning("could not write the trace to %s (cluster.tracer.output_file): %s",
                        path, exc)

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop everything this Cluster started (and, in attach mode, its groups).

        Work still pending fails with ``PeerLostError``; every later call, channel operation
        or launch through this Cluster raises [`ClusterClosedError`][aiorl.ClusterClosedError] at
        once.
        """
        self._close(None)

    def _close(self, registry_died: str | None) -> None:
        """[`close`][aiorl.Cluster.close]; ``registry_died`` says how the embedded registry ended,
        when that is why (then pending work and later operations name it, and the registry is not
        asked anything). One close at a time: a second caller waits for the first."""
        with self._close_lock:
            if self._closed:
                return
            if registry_died is not None:
                self._closed_reason = (
                    f"the embedded registry of this Cluster {registry_died}, so the Cluster "
                    "closed itself and its node agents stopped its workers; create a new "
                    "aiorl.Cluster()")
            if self._trace_output is not None and registry_died is None and (
                    self._session is not None):
                self._write_trace(self._trace_output)
            self._closed = True
            _live_clusters.discard(self)
            if self._stop_tracing_on_close:
                _trace.disable()
            if self._session is not None:
                self._session.close(close_owned_groups=not self.embedded,
                                    reason=self._closed_reason,
                                    registry_alive=registry_died is None)
            if self._embedded is not None:
                self._embedded.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> Cluster:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def __repr__(self) -> str:
        mode = "embedded" if self.embedded else "attached"
        if self._closed or self._session is None:
            return f"<Cluster {mode} {'closed' if self._closed else '(not connected)'}>"
        return f"<Cluster {mode} {self._session.registry_address} nodes={self.num_nodes}>"


def _registry_died(ref: weakref.ref[Cluster]) -> None:
    """The embedded registry of the Cluster ``ref`` ended (on the runtime loop): close the
    Cluster from a thread of its own (closing stops this loop)."""
    cluster = ref()
    if cluster is None or cluster._closed or cluster._embedded is None:
        return
    embedded = cluster._embedded

    def close() -> None:
        how = embedded.registry_exit()
        log.error("the embedded registry %s: closing the Cluster", how)
        cluster._close(how)

    RuntimeThread(target=close, name="aiorl-registry-lost", daemon=True).start()


def _registry_address(registry: str | None, address: str | None,
                      cfg: dict[str, Any]) -> str | None:
    """The registry to attach to (normalised), or None for an embedded cluster.

    ``address=`` is Ray's name for ``registry=``; then ``$AIORL_REGISTRY``, then the config.
    """
    if registry and address:
        mine = normalize_address(registry, "Cluster(registry=...)")
        if normalize_address(address, "Cluster(address=...)") != mine:
            raise AddressError(
                f"Cluster() got registry={registry!r} and address={address!r}, two different "
                "registries: address= is Ray's name for registry=, so give one of them")
        return mine
    for value, source in ((registry, "Cluster(registry=...)"), (address, "Cluster(address=...)"),
                          (os.environ.get("AIORL_REGISTRY"), "$AIORL_REGISTRY"),
                          (cfg.get("registry"), "cluster_cfg's cluster.registry")):
        if value:
            return normalize_address(value, source)
    return None


#: The keys of RLinf's ``cluster.tracer`` section that aiorl maps onto its own tracing.
_TRACER_KEYS = ("enable", "output_file")


def _tracer_section(cfg: dict[str, Any]) -> tuple[bool, str | None]:
    """RLinf's ``cluster.tracer: {enable, output_file}``: whether to trace this driver and its
    workers (as ``trace=True``), and where ``close`` writes the Perfetto/Chrome trace.

    Raises:
        ValueError: the section is not a mapping, has a key aiorl does not know (RLinf's
            own trace server settings included: aiorl pulls the spans itself), or a value of
            the wrong type.
    """
    section = cfg.get("tracer")
    if section is None:
        return False, None
    if not isinstance(section, dict):
        raise ValueError(f"cluster.tracer must be a mapping with keys {', '.join(_TRACER_KEYS)}, "
                         f"got {type(section).__name__}")
    unknown = sorted(str(k) for k in section if k not in _TRACER_KEYS)
    if unknown:
        raise ValueError(f"cluster.tracer: unknown key(s) {', '.join(unknown)}; aiorl reads "
                         f"{', '.join(_TRACER_KEYS)} (it pulls every process's spans itself, "
                         "so no trace server is configured)")
    enable = section.get("enable", False)
    output = section.get("output_file")
    if not isinstance(enable, bool):
        raise ValueError(f"cluster.tracer.enable must be true or false, got {enable!r}")
    if output is not None and (not isinstance(output, str) or not output):
        raise ValueError(f"cluster.tracer.output_file must be a file path, got {output!r}")
    return enable, (os.path.expanduser(output) if enable and output else None)


def _cluster_section(cfg: Any) -> dict[str, Any]:
    """The ``cluster:`` section of a config (DictConfig or dict), as a plain dict."""
    if cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:
        pass
    if not isinstance(cfg, dict):
        raise TypeError(f"cluster_cfg must be a dict or DictConfig, got {type(cfg).__name__}")
    section = cfg.get("cluster", cfg)
    return dict(section) if isinstance(section, dict) else {}
