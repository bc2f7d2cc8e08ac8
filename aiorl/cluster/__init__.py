"""The driver's side of a cluster: the ``Cluster`` façade, its driver session and, in
embedded mode, the registry and node agents it runs as child processes.

Layer: beside ``node``; above ``actors``.
"""

from aiorl.cluster.cluster import Cluster
from aiorl.cluster.driver import DriverSession
from aiorl.cluster.embedded import EmbeddedProcesses

__all__ = ["Cluster", "DriverSession", "EmbeddedProcesses"]
