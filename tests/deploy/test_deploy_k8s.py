"""The Kubernetes manifests in ``deploy/kubernetes/`` (docs/deploy.md, section Kubernetes).

No Kubernetes cluster runs here. What this checks instead:

* every object validates against the Kubernetes API schemas that ``kubernetes-validate`` ships
  (offline, strict: an unknown field fails), and follows the API server's rules for names that
  the schemas leave out;
* the files agree with each other: names, ports, labels and selectors, the Secret's name and
  key (as docs/deploy.md creates it), volume mounts, the registry address every client uses;
* they agree with aiorl: every option they pass to ``aiorl-registry``, ``aiorl-node`` and
  ``aiorl status`` (containers and probes, ``sh -c`` scripts included) is listed by that
  program's ``--help``;
* the registry's and the agent's commands, their probes and the driver Job's script run on this
  machine, with only the addresses, the registry's port and the key's path changed.
"""

from __future__ import annotations

import base64
import copy
import functools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate  # the `test` extra: a missing package fails here, it never skips
import pytest
import yaml

from aiorl.transport.address import normalize_address
from tests._paths import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

ROOT = REPO_ROOT
K8S = ROOT / "deploy" / "kubernetes"
DOCS = ROOT / "docs" / "deploy.md"

#: The oldest Kubernetes the manifests need (the apps.kubernetes.io/pod-index label is 1.28's),
#: and the newest whose schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.28.0", "1.37.0")

WORKLOADS = ("StatefulSet", "Deployment", "DaemonSet", "Job")
SHELLS = ("sh", "/bin/sh", "bash", "/bin/bash")
PROBES = ("readinessProbe", "livenessProbe", "startupProbe")
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
LOOPBACK = ("127.0.0.1", "::1", "localhost")


# ---------------------------------------------------------------------------- the manifests
@dataclass(frozen=True)
class Obj:
    file: str
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc["kind"])

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])

    def __str__(self) -> str:
        return f"{self.file}: {self.kind.lower()}/{self.name}"


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@functools.cache
def objects() -> tuple[Obj, ...]:
    found = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append(Obj(path.name, doc))
    return tuple(found)


def find(kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objects() if o.kind == kind and (name is None or o.name == name)]


def workloads() -> list[Obj]:
    return [o for o in objects() if o.kind in WORKLOADS]


def pod_spec(o: Obj) -> dict[str, Any]:
    return o.doc["spec"]["template"]["spec"]


def pod_labels(o: Obj) -> dict[str, str]:
    return o.doc["spec"]["template"]["metadata"].get("labels", {})


def containers(o: Obj) -> list[dict[str, Any]]:
    spec = pod_spec(o)
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def the(kind: str, name: str) -> Obj:
    found = find(kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def registry_workload() -> Obj:
    """The workload whose container runs ``aiorl-registry``."""
    found = [o for o in workloads() for c in containers(o) if c.get("command", [None])[0]
             == "aiorl-registry"]
    assert len(found) == 1, f"one workload must run aiorl-registry, found {len(found)}"
    return found[0]


def agent_workload() -> Obj:
    found = [o for o in workloads() for c in containers(o) if c.get("command", [None])[0]
             == "aiorl-node"]
    assert len(found) == 1, f"one workload must run aiorl-node, found {len(found)}"
    return found[0]


def driver_job() -> Obj:
    jobs = find("Job")
    assert len(jobs) == 1, f"one driver Job, found {len(jobs)}"
    return jobs[0]


def registry_service() -> Obj:
    """The Service that selects the registry's pods."""
    labels = pod_labels(registry_workload())
    found = [s for s in find("Service") if selects(s.doc["spec"].get("selector"), labels)]
    assert len(found) == 1, f"one Service must select the registry, found {len(found)}"
    return found[0]


def selects(selector: dict[str, str] | None, labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------------- commands in them
@dataclass
class Invocation:
    """One command line of a manifest: a container's command + args, or a probe's."""

    obj: Obj
    container: dict[str, Any]
    where: str
    argv: list[str]
    shell: bool = False  # a command of an ``sh -c`` script

    @property
    def program(self) -> str:
        name = os.path.basename(self.argv[0])
        return f"aiorl {self.argv[1]}" if name == "aiorl" and len(self.argv) > 1 else name

    @property
    def args(self) -> list[str]:
        return self.argv[2:] if os.path.basename(self.argv[0]) == "aiorl" else self.argv[1:]

    def __str__(self) -> str:
        return f"{self.obj} container {self.container['name']} {self.where}"


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of an ``sh -c`` script (split at pipes, ``;``, ``&&``, ``||``)."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set("|&;()"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def command_lines(container: dict[str, Any]) -> list[tuple[str, list[str]]]:
    lines = []
    if "command" in container:
        lines.append(("command", [*container["command"], *container.get("args", [])]))
    for probe in PROBES:
        if "exec" in container.get(probe, {}):
            lines.append((probe, list(container[probe]["exec"]["command"])))
    for hook in ("postStart", "preStop"):
        if "exec" in container.get("lifecycle", {}).get(hook, {}):
            lines.append((hook, list(container["lifecycle"][hook]["exec"]["command"])))
    return lines


def invocations() -> list[Invocation]:
    found = []
    for o in workloads():
        for c in containers(o):
            for where, argv in command_lines(c):
                if argv[0] in SHELLS and argv[1:2] == ["-c"]:
                    found += [Invocation(o, c, where, cmd, shell=True)
                              for cmd in shell_commands(argv[2])]
                else:
                    found.append(Invocation(o, c, where, argv))
    return found


@functools.cache
def console_scripts() -> dict[str, tuple[str, str]]:
    """``[project.scripts]`` of pyproject.toml: program -> (module, function)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[)", text, re.M | re.S)
    assert section, "pyproject.toml has no [project.scripts]"
    return {m[1]: (m[2], m[3]) for m in
            re.finditer(r'^([\w-]+)\s*=\s*"([\w.]+):(\w+)"', section[1], re.M)}


def aiorl_invocations() -> list[Invocation]:
    return [i for i in invocations() if os.path.basename(i.argv[0]) in console_scripts()]


@functools.cache
def help_options(program: str) -> dict[str, bool]:
    """The options ``program --help`` lists (``aiorl status``: the subcommand's), each with
    whether it takes a value."""
    name, *sub = program.split()
    module, function = console_scripts()[name]
    launcher = (f"import sys; from {module} import {function} as main; "
                f"sys.argv[0] = {name!r}; sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", launcher, *sub, "--help"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, f"{program} --help failed:\n{done.stderr}"
    options = {m[1]: bool(m[2]) for m in re.finditer(
        r"^  (?:-\w, )?(--[a-z][\w-]*)(?: ([A-Z][A-Z0-9_=]*))?(?:\s|$)", done.stdout, re.M)}
    assert "--help" in options and len(options) > 2, f"cannot read {program} --help:\n{done.stdout}"
    return options


def parse_options(inv: Invocation) -> dict[str, list[str]]:
    """``inv``'s options, checked against its program's ``--help``: option -> its values."""
    known = help_options(inv.program)
    parsed: dict[str, list[str]] = {}
    args, i = inv.args, 0
    while i < len(args):
        token = args[i]
        assert token.startswith("--"), f"{inv}: {token!r} is not an option of {inv.program}"
        name, eq, value = token.partition("=")
        assert name in known, (
            f"{inv}: {inv.program} has no option {name} (its --help lists {sorted(known)})")
        if known[name] and not eq:
            assert i + 1 < len(args) and not args[i + 1].startswith("--"), (
                f"{inv}: {name} needs a value")
            i += 1
            value = args[i]
        assert known[name] or not eq, f"{inv}: {name} takes no value"
        parsed.setdefault(name, []).append(value if known[name] else "")
        i += 1
    return parsed


def option(inv: Invocation, name: str) -> str:
    values = parse_options(inv).get(name)
    assert values and len(values) == 1, f"{inv}: needs exactly one {name}"
    return values[0]


_K8S_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """What Kubernetes makes of ``$(NAME)`` in a container's command and args."""
    def one(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        return env.get(m[1], m[0])
    return _K8S_VAR.sub(one, text)


# ---------------------------------------------------------------------------- the key
@dataclass(frozen=True)
class KeyMount:
    volume: str
    secret: str
    item_key: str
    mount_path: str
    item_path: str
    mode: int

    @property
    def path(self) -> str:
        """The key file's path inside the container."""
        return f"{self.mount_path.rstrip('/')}/{self.item_path}"


def documented_secret() -> tuple[str, str, str]:
    """(Secret name, key, local file) of the one ``kubectl create secret`` line of the docs'
    Kubernetes section."""
    found = re.findall(r"^kubectl create secret generic (\S+) --from-file=([^=\s]+)=(\S+)\s*$",
                       kubernetes_docs(), re.M)
    assert len(found) == 1, "docs/deploy.md, Kubernetes: one `kubectl create secret` line"
    return found[0]


def documented_keygen() -> list[str]:
    found = re.findall(r"^(python -c \".*ClusterKeys\.generate\(\)\.save\(.*\)\")\s*$",
                       kubernetes_docs(), re.M)
    assert len(found) == 1, "docs/deploy.md, Kubernetes: one `python -c ...` key line"
    return shlex.split(found[0])


def kubernetes_docs() -> str:
    text = DOCS.read_text()
    assert "\n## Kubernetes\n" in text, "docs/deploy.md has no section Kubernetes"
    return text[text.rindex("\n## Kubernetes\n"):]


def key_mount(o: Obj, container: dict[str, Any]) -> KeyMount:
    """Where ``container`` of ``o`` reads the cluster key (its secret volume's one item)."""
    secret_volumes = {v["name"]: v for v in pod_spec(o).get("volumes", []) if "secret" in v}
    mounts = [m for m in container.get("volumeMounts", []) if m["name"] in secret_volumes]
    assert len(mounts) == 1, f"{o} container {container['name']}: mount the key Secret once"
    mount = mounts[0]
    volume = secret_volumes[mount["name"]]["secret"]
    items = volume.get("items", [])
    assert len(items) == 1, f"{o}: the key volume mounts the Secret's one key as one file"
    assert "subPath" not in mount, f"{o}: a subPath mount never sees a replaced Secret"
    assert mount.get("readOnly") is True, f"{o} container {container['name']}: key not readOnly"
    mode = items[0].get("mode", volume.get("defaultMode", 0o644))
    return KeyMount(mount["name"], volume["secretName"], items[0]["key"], mount["mountPath"],
                    items[0]["path"], mode)


# ---------------------------------------------------------------------------- schemas
def kubectl_secret(key_file: Path) -> dict[str, Any]:
    """The Secret ``kubectl create secret generic`` makes from the docs' line."""
    name, key, _ = documented_secret()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "type": "Opaque",
            "data": {key: base64.b64encode(key_file.read_bytes()).decode()}}


@pytest.fixture(scope="module")
def generated_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A key made by the docs' own ``python -c`` line, in the file the Secret line reads."""
    where = tmp_path_factory.mktemp("key")
    argv = documented_keygen()
    assert argv[0] == "python"
    subprocess.run([sys.executable, *argv[1:]], cwd=where, check=True, timeout=60,
                   env={k: v for k, v in os.environ.items() if not k.startswith("AIORL_")})
    path = where / documented_secret()[2]
    assert path.is_file(), f"the key line does not write {documented_secret()[2]}, which the " \
                           "Secret line reads"
    assert path.stat().st_mode & 0o777 == 0o600
    return path


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(
        version: str, generated_key: Path) -> None:
    assert objects(), "no manifests in deploy/kubernetes"
    for o in objects():
        try:
            kubernetes_validate.validate(o.doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{o}: Kubernetes {version}: {exc.message} at "
                                 f"{'/'.join(map(str, exc.absolute_path))}") from None
    kubernetes_validate.validate(kubectl_secret(generated_key), version, strict=True)


def test_strict_validation_refuses_a_misspelt_field_and_a_wrong_type() -> None:
    """The validator bites: an unknown field and a string where a number goes fail."""
    sts = copy.deepcopy(registry_workload().doc)
    port = sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]
    port["containerPorts"] = port.pop("containerPort")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[-1], strict=True)
    sts = copy.deepcopy(registry_workload().doc)
    sts["spec"]["replicas"] = "1"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[-1], strict=True)


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
PORT_NAME = re.compile(r"(?=.*[a-z])(?!.*--)[a-z0-9]([a-z0-9-]*[a-z0-9])?")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DATA_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def test_names_follow_the_api_servers_rules() -> None:
    """What the API server checks and the JSON schemas do not (apimachinery validation)."""
    for o in objects():
        # Services are DNS-1035 labels; a StatefulSet's name plus "-" and a 10-character
        # revision hash is a label value (63): at most 52.
        rule = DNS_1035 if o.kind == "Service" else DNS_LABEL
        assert rule.fullmatch(o.name) and len(o.name) <= 52, f"{o}: bad name"
        labels = dict(o.doc["metadata"].get("labels", {}))
        if o.kind in WORKLOADS:
            labels.update(pod_labels(o))
        for k, v in labels.items():
            assert LABEL_KEY.fullmatch(k) and LABEL_VALUE.fullmatch(v) and len(v) <= 63, (
                f"{o}: bad label {k}={v}")
        if o.kind == "ConfigMap":
            assert all(DATA_KEY.fullmatch(k) for k in o.doc.get("data", {})), f"{o}: data key"
        for p in o.doc["spec"].get("ports", []) if o.kind == "Service" else []:
            assert "name" not in p or DNS_LABEL.fullmatch(p["name"]), f"{o}: port {p['name']}"
            target = p.get("targetPort")
            assert not isinstance(target, str) or (PORT_NAME.fullmatch(target) and len(target)
                                                   <= 15), f"{o}: targetPort {target}"
        if o.kind not in WORKLOADS:
            continue
        for v in pod_spec(o).get("volumes", []):
            assert DNS_LABEL.fullmatch(v["name"]), f"{o}: volume name {v['name']}"
        for c in containers(o):
            assert DNS_LABEL.fullmatch(c["name"]), f"{o}: container name {c['name']}"
            for p in c.get("ports", []):
                assert "name" not in p or (PORT_NAME.fullmatch(p["name"]) and len(p["name"])
                                           <= 15), f"{o}: port name {p['name']}"
            for e in c.get("env", []):
                assert ENV_NAME.fullmatch(e["name"]), f"{o}: env name {e['name']}"
    name, key, _ = documented_secret()
    assert DNS_LABEL.fullmatch(name) and DATA_KEY.fullmatch(key)


def test_the_kustomization_lists_every_manifest_but_the_driver_job() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    assert set(kustomization) <= {"apiVersion", "kind", "resources", "images", "namespace",
                                  "labels", "patches"}, "a kustomization field not checked here"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed)) and all((K8S / r).is_file() for r in listed)
    jobs = {o.file for o in find("Job")}
    assert set(listed) == {p.name for p in manifest_files()} - jobs, (
        "every manifest but the driver Job's is part of the cluster")
    assert not jobs & set(listed), "the driver Job is started on its own, not by apply -k"


# ---------------------------------------------------------------------------- consistency
def test_services_select_one_workload_and_ports_line_up() -> None:
    for o in workloads():
        spec = o.doc["spec"]
        if o.kind != "Job":
            assert selects(spec["selector"]["matchLabels"], pod_labels(o)), (
                f"{o}: the selector does not match its own pods")
        if o.kind == "StatefulSet":
            governing = the("Service", spec["serviceName"])
            assert selects(governing.doc["spec"]["selector"], pod_labels(o)), (
                f"{o}: serviceName {governing.name} does not select its pods")
    for s in find("Service"):
        selected = [o for o in workloads() if selects(s.doc["spec"].get("selector"), pod_labels(o))]
        assert len(selected) == 1, f"{s} selects the pods of {[str(o) for o in selected]}"

    registry, service = registry_workload(), registry_service()
    assert registry.kind == "StatefulSet" and registry.doc["spec"]["replicas"] == 1
    assert registry.doc["spec"]["serviceName"] == service.name
    (container,) = [c for c in containers(registry) if c["command"] == ["aiorl-registry"]]
    (inv,) = [i for i in aiorl_invocations() if i.container is container and i.where == "command"]
    listen_port = int(option(inv, "--port"))
    assert option(inv, "--host") == "0.0.0.0", "the Service forwards to the pod IP: listen on all"
    (port,) = service.doc["spec"]["ports"]
    target = port["targetPort"]
    named = {p["name"]: p["containerPort"] for p in container["ports"] if "name" in p}
    assert (named.get(target) if isinstance(target, str) else target) == listen_port, (
        f"{service}: targetPort {target} is not the port aiorl-registry listens on")
    assert port["port"] == listen_port and port.get("protocol", "TCP") == "TCP", (
        f"{service}: port {port['port']}; the registry listens on {listen_port}")
    assert listen_port in [p["containerPort"] for p in container["ports"]], (
        f"{registry}: no containerPort {listen_port}")

    # Metrics ask for no key: on loopback, and no port or Service exposes them.
    options = parse_options(inv)
    if "--metrics-port" in options:
        host = options.get("--metrics-host", ["127.0.0.1"])[0]
        assert host in LOOPBACK, f"{inv}: metrics (no key) on {host}, not loopback"
        metrics = int(options["--metrics-port"][0])
        exposed = {p["containerPort"] for c in containers(registry) for p in c.get("ports", [])}
        exposed |= {p.get("targetPort") for s in find("Service") for p in s.doc["spec"].get(
            "ports", [])}
        assert metrics not in exposed and "metrics" not in named, f"{registry}: metrics exposed"


def test_every_client_reaches_the_registry_through_its_service() -> None:
    service = registry_service()
    port = service.doc["spec"]["ports"][0]["port"]
    through_service = {f"tcp://{service.name}{suffix}:{port}" for suffix in
                       ("", ".default.svc", ".default.svc.cluster.local")}
    (registry_inv,) = [i for i in aiorl_invocations() if i.program == "aiorl-registry"]
    own = f"tcp://127.0.0.1:{option(registry_inv, '--port')}"
    seen = {"agent": 0, "agent probes": 0, "registry probes": 0, "driver": 0}
    for inv in aiorl_invocations():
        if inv.program == "aiorl-registry":
            continue
        address = normalize_address(option(inv, "--registry"), str(inv))
        if inv.obj is registry_workload():
            assert address == own, f"{inv}: the registry's own probe asks {address}"
            seen["registry probes"] += 1
        else:
            assert address in through_service, f"{inv}: {address} is not the registry Service"
            seen["agent" if inv.where == "command" else "agent probes"] += 1
    job = driver_job()
    for c in containers(job):
        address = normalize_address(env_of(c)["AIORL_REGISTRY"]["value"], "AIORL_REGISTRY")
        assert address in through_service, f"{job}: AIORL_REGISTRY {address}"
        seen["driver"] += 1
    assert seen["agent"] == 1 and seen["driver"] == 1 and seen["agent probes"] >= 1 and seen[
        "registry probes"] >= 1, seen


def test_the_key_secret_is_mounted_read_only_where_every_process_reads_it() -> None:
    name, key, _ = documented_secret()
    for o in workloads():
        security = pod_spec(o).get("securityContext", {})
        if security.get("runAsNonRoot") or security.get("runAsUser", 0) != 0:
            # A Secret's files belong to root: fsGroup is what lets this user read them.
            assert "fsGroup" in security, f"{o}: non-root without fsGroup cannot read the key"
        for c in containers(o):
            mount = key_mount(o, c)
            assert (mount.secret, mount.item_key) == (name, key), (
                f"{o}: mounts Secret {mount.secret} key {mount.item_key}; the docs create "
                f"{name} key {key}")
            assert mount.mode in (0o400, 0o600), f"{o}: key mode {mount.mode:o}"
            env = env_of(c)
            if "AIORL_KEY_FILE" in env:
                assert env["AIORL_KEY_FILE"]["value"] == mount.path
            runs_aiorl = [i for i in aiorl_invocations() if i.container is c]
            for inv in runs_aiorl:
                assert option(inv, "--key-file") == mount.path, f"{inv}: --key-file"
            assert runs_aiorl or env.get("AIORL_KEY_FILE", {}).get("value") == mount.path, (
                f"{o} container {c['name']}: neither --key-file nor AIORL_KEY_FILE")


def test_agents_advertise_their_pod_ip_and_hold_gpus() -> None:
    agents = agent_workload()
    assert agents.kind in ("StatefulSet", "DaemonSet")
    (container,) = [c for c in containers(agents) if c["command"] == ["aiorl-node"]]
    env = env_of(container)
    (inv,) = [i for i in aiorl_invocations() if i.container is container and i.where == "command"]

    def field_of(value: str) -> str:
        m = re.fullmatch(r"\$\((\w+)\)", value)
        assert m and m[1] in env, f"{inv}: {value!r} is not a $(VAR) of the container's env"
        return str(env[m[1]]["valueFrom"]["fieldRef"]["fieldPath"])

    assert field_of(option(inv, "--host")) == "status.podIP", f"{inv}: --host is not the pod IP"
    assert env["AIORL_NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", (
        "aiorl-node and the probes read AIORL_NODE_IP: the pod IP")
    if agents.kind == "StatefulSet":
        assert field_of(option(inv, "--node-rank")) == POD_INDEX
    resources = container["resources"]
    gpus = resources["limits"]["nvidia.com/gpu"]
    assert isinstance(gpus, int) and gpus > 0
    assert resources["requests"]["nvidia.com/gpu"] == gpus, "extended resources: requests=limits"
    shm = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    volumes = {v["name"]: v for v in pod_spec(agents)["volumes"]}
    assert shm and volumes[shm[0]["name"]]["emptyDir"]["medium"] == "Memory"
    affinity = pod_spec(agents)["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(t["topologyKey"] == "kubernetes.io/hostname" and selects(
        t["labelSelector"]["matchLabels"], pod_labels(agents)) for t in affinity), (
        "one agent per machine")

    # Every $(VAR) in a command is the container's (else Kubernetes leaves it as it is), and
    # every $VAR in a probe's script too (the shell reads the container's environment).
    for o in workloads():
        for c in containers(o):
            names = set(env_of(c))
            for where, argv in command_lines(c):
                for token in argv:
                    # The kubelet expands $(NAME) in probe commands too (from literal env
                    # values): keep $( out of probes, so a shell's $(...) is never taken for one.
                    assert where == "command" or "$(" not in token and "$$" not in token, (
                        f"{o} {c['name']} {where}: $( or $$ in a probe")
                    used = set(re.findall(r"\$\((\w+)\)", token))
                    if where != "command" and argv[0] in SHELLS:
                        used |= set(re.findall(r"\$\{?([A-Za-z_]\w*)", token))
                    assert used <= names, f"{o} {c['name']} {where}: {used - names} undefined"

    job = driver_job()
    for c in containers(job):
        assert int(env_of(c)["AIORL_NUM_NODES"]["value"]) == agents.doc["spec"]["replicas"], (
            "the driver waits for as many nodes as there are agents")
    images = {c["image"] for o in workloads() for c in containers(o)}
    assert len(images) == 1, f"one image, one aiorl version everywhere: {images}"


def test_the_driver_job_runs_the_configmaps_script() -> None:
    job = driver_job()
    assert pod_spec(job)["restartPolicy"] == "Never"
    (container,) = containers(job)
    compile(configmap_file(job, container), "train.py", "exec")


def configmap_file(job: Obj, container: dict[str, Any]) -> str:
    """The text of the ConfigMap file that the Job's command runs."""
    volumes = {v["name"]: v for v in pod_spec(job)["volumes"]}
    for m in container["volumeMounts"]:
        cm = volumes[m["name"]].get("configMap")
        if cm is None:
            continue
        for key, text in the("ConfigMap", cm["name"]).doc["data"].items():
            if f"{m['mountPath'].rstrip('/')}/{key}" in container["command"]:
                return str(text)
    raise AssertionError(f"{job}: the command runs no file of a ConfigMap volume")


def test_every_option_the_manifests_pass_exists() -> None:
    found = aiorl_invocations()
    programs = {i.program for i in found}
    assert programs == {"aiorl-registry", "aiorl-node", "aiorl status"}, programs
    for inv in found:
        parse_options(inv)  # each option listed by the program's --help, with its value
    for name in ("aiorl-registry", "aiorl-node", "aiorl"):
        assert name in console_scripts(), f"{name} is not a console script of the package"


# ---------------------------------------------------------------------------- on this machine
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Local:
    """The manifests' commands on this machine: their addresses, port and key path swapped."""

    tmp: Path
    port: int = field(default_factory=_free_port)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def key(self) -> KeyMount:
        (inv,) = [i for i in aiorl_invocations() if i.program == "aiorl-registry"]
        return key_mount(inv.obj, inv.container)

    @property
    def key_volume(self) -> Path:
        return self.tmp / "secret-volume"

    def swaps(self) -> dict[str, str]:
        service = registry_service()
        (registry_inv,) = [i for i in aiorl_invocations() if i.program == "aiorl-registry"]
        return {f"tcp://{service.name}:{service.doc['spec']['ports'][0]['port']}": self.address,
                f"tcp://127.0.0.1:{option(registry_inv, '--port')}": self.address,
                self.key.path: str(self.key_volume / self.key.item_path)}

    def localize(self, text: str) -> str:
        for old, new in self.swaps().items():
            text = text.replace(old, new)
        left = [s for s in (f"{registry_service().name}:", self.key.mount_path) if s in text]
        assert not left, f"{text!r} still names {left}"
        return text

    def environment(self, container: dict[str, Any], **fields: str) -> dict[str, str]:
        """This process's environment without aiorl's variables, the venv's programs first on
        PATH, and the container's env (``fields``: the downward API's values)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIORL_")}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        for name, entry in env_of(container).items():
            if "value" in entry:
                env[name] = self.localize(str(entry["value"]))
            else:
                env[name] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        return env

    def command(self, container: dict[str, Any], argv: list[str], env: dict[str, str],
                overrides: dict[str, str] | None = None) -> list[str]:
        out = [self.localize(k8s_expand(a, env)) for a in argv]
        for i, token in enumerate(out[:-1]):
            if overrides and token in overrides:
                out[i + 1] = overrides[token]
        program = Path(sys.executable).parent / out[0]
        assert program.exists(), f"{out[0]} is not installed next to {sys.executable}"
        return out

    def lay_out_key(self, key_file: Path) -> None:
        """The key as the kubelet lays out a Secret volume: ``ITEM -> ..data/ITEM``, ``..data
        -> ..TIMESTAMP``, and the file itself, with the volume's mode, in ``..TIMESTAMP``."""
        item, volume = self.key.item_path, self.key_volume
        stamped = volume / "..2026_01_01_00_00_00.000000001"
        stamped.mkdir(parents=True)
        (stamped / item).write_bytes(key_file.read_bytes())
        (stamped / item).chmod(self.key.mode)
        (volume / "..data").symlink_to(stamped.name)
        (volume / item).symlink_to(f"..data/{item}")

    def start(self, argv: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
        with open(self.tmp / log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM, as Kubernetes stops a pod; then whatever is left of its session."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        deadline = time.monotonic() + 10  # the agent's zygote and workers end after it
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log(self, name: str) -> str:
        path = self.tmp / name
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def run_probe(argv: list[str], env: dict[str, str]) -> int:
    return subprocess.run(argv, env=env, capture_output=True, timeout=60).returncode


def wait_for_probe(argv: list[str], env: dict[str, str], what: str, local: Local,
                   within: float = 60) -> None:
    deadline = time.monotonic() + within
    while run_probe(argv, env) != 0:
        assert time.monotonic() < deadline, (
            f"{what} did not pass within {within:.0f} s\nregistry:\n{local.log('registry.log')}"
            f"\nagent:\n{local.log('agent.log')}")
        time.sleep(0.5)


@dataclass
class Pods:
    local: Local
    registry: subprocess.Popen[bytes]
    agent: subprocess.Popen[bytes]
    agent_env: dict[str, str]
    probes: dict[str, list[str]]  # "registry readinessProbe", "agent livenessProbe", ...

    def agent_probe(self, probe: str, pod_ip: str) -> int:
        return run_probe(self.probes[f"agent {probe}"], {**self.agent_env, "AIORL_NODE_IP": pod_ip})


@contextmanager
def registry_and_agent(tmp: Path, key_file: Path) -> Iterator[Pods]:
    """The registry's and the agent's containers, started as their manifests say, on this
    machine; each ready when its own readiness probe passes."""
    local = Local(tmp)
    registry_obj, agent_obj = registry_workload(), agent_workload()
    (reg_c,) = [c for c in containers(registry_obj) if c["command"] == ["aiorl-registry"]]
    (agent_c,) = [c for c in containers(agent_obj) if c["command"] == ["aiorl-node"]]
    local.lay_out_key(key_file)
    pod_fields = {"status.podIP": "127.0.0.1", POD_INDEX: "0"}
    reg_env = local.environment(reg_c, **pod_fields)
    agent_env = local.environment(agent_c, **pod_fields)
    probes = {}
    for who, c, env in (("registry", reg_c, reg_env), ("agent", agent_c, agent_env)):
        for probe in PROBES:
            if probe in c:
                argv = list(c[probe]["exec"]["command"])
                if argv[0] in SHELLS:  # the script's addresses and key; the shell expands $VAR
                    probes[f"{who} {probe}"] = [*argv[:2], local.localize(argv[2])]
                else:
                    probes[f"{who} {probe}"] = local.command(c, argv, env)
    try:
        registry = local.start(local.command(
            reg_c, [*reg_c["command"], *reg_c["args"]], reg_env,
            {"--host": "127.0.0.1", "--port": str(local.port), "--metrics-port": "0"}),
            reg_env, "registry.log")
        wait_for_probe(probes["registry readinessProbe"], reg_env, "the registry's readiness",
                       local)
        agent = local.start(local.command(agent_c, [*agent_c["command"], *agent_c["args"]],
                                          agent_env), agent_env, "agent.log")
        wait_for_probe(probes["agent readinessProbe"], agent_env, "the agent's readiness", local)
        yield Pods(local, registry, agent, agent_env, probes)
    finally:
        for proc in reversed(local.procs):
            local.stop(proc)


def test_probes_pass_and_fail_when_they_should(tmp_path: Path, generated_key: Path) -> None:
    with registry_and_agent(tmp_path, generated_key) as pods:
        assert run_probe(pods.probes["registry livenessProbe"], pods.agent_env) == 0
        assert pods.agent_probe("livenessProbe", "127.0.0.1") == 0
        # A pod IP the registry does not list: not ready, and (the registry answers) not alive.
        assert pods.agent_probe("readinessProbe", "127.0.0.2") != 0
        assert pods.agent_probe("livenessProbe", "127.0.0.2") != 0
        # The registry gone: the agent is not ready, but its liveness probe does not restart
        # it (that would kill its workers; it rejoins a restarted registry by itself).
        pods.local.stop(pods.registry)
        assert run_probe(pods.probes["registry readinessProbe"], pods.agent_env) != 0
        assert pods.agent_probe("readinessProbe", "127.0.0.1") != 0
        assert pods.agent_probe("livenessProbe", "127.0.0.1") == 0
        assert pods.agent.poll() is None, "the agent outlives its registry"


def test_the_driver_jobs_script_runs_against_the_registry_and_agent(
        tmp_path: Path, generated_key: Path) -> None:
    job = driver_job()
    (container,) = containers(job)
    with registry_and_agent(tmp_path, generated_key) as pods:
        # The ConfigMap's files where the Job mounts them (under tmp), the Job's env.
        volumes = {v["name"]: v for v in pod_spec(job)["volumes"]}
        argv = list(container["command"])
        for m in container["volumeMounts"]:
            cm = volumes[m["name"]].get("configMap")
            if cm is None:
                continue
            where = tmp_path / "configmap" / m["name"]
            where.mkdir(parents=True)
            for key, text in the("ConfigMap", cm["name"]).doc["data"].items():
                (where / key).write_text(text)
            argv = [a.replace(m["mountPath"].rstrip("/"), str(where)) for a in argv]
        assert argv[0] == "python" and Path(argv[1]).is_file(), argv
        env = pods.local.environment(container)
        env["AIORL_NUM_NODES"] = "1"  # one agent on this machine
        env["AIORL_WAIT_S"] = "60"
        done = subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True,
                              text=True, timeout=90, cwd=tmp_path)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
        m = re.search(r"^(\d+) ranks on 1 node\(s\) answered; sum (\d+)$", done.stdout, re.M)
        assert m, done.stdout
        ranks = int(m[1])
        assert ranks >= 1 and int(m[2]) == ranks + ranks * (ranks - 1) // 2
