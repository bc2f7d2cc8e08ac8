"""``aiorl demo``: a small but complete distributed RL job, to show what aiorl is for.

One command starts a cluster (embedded by default: a registry and node agents on this
machine), launches ``--rollouts`` rollout workers and ``--trainers`` trainer workers, and
trains a CartPole policy with REINFORCE:

* rollout workers ([`PollingWorker`][aiorl.PollingWorker]) play episodes of varying length with
  their current policy and ``put`` each trajectory into a channel, weight = its length;
* trainers take ``get_batch(--batch-weight)`` in turn, compute policy gradients, average
  them on trainer 0 (P2P ``send``/``recv``), which steps Adam and publishes the new,
  versioned weights once (`aiorl.weights`: written once into shared memory on its
  node, relayed once to every other node); the other trainers pull each version before
  their next step, and rollouts pull the newest one in between episodes without ever
  waiting for it;
* the driver shows live progress and prints a summary, then closes the groups and the
  cluster, also on errors, Ctrl-C and SIGTERM.

See ``docs/demo.md``. Usable as a subcommand of the ``aiorl`` entry point
(`add_parser`, `run`) or as ``python -m aiorl.cli.demo``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["add_parser", "main", "run"]

_DESCRIPTION = (
    "Run a small distributed RL job (CartPole, REINFORCE) on aiorl: rollout workers feed "
    "trajectories through a channel to trainers, trainer 0 publishes each new weight "
    "version once (aiorl.weights) and every worker pulls the newest. Shows live progress "
    "and a summary. Starts an embedded cluster unless --registry is given."
)

ROLLOUT_GROUP = "rollout"
TRAINER_GROUP = "trainer"
CHANNEL_NAME = "demo-trajectories"

#: Seconds between two refreshes of the progress view (and of the stats calls behind it).
REFRESH_S = 0.25
#: How long one stats round trip may take before the demo gives up on the workers.
STATS_TIMEOUT_S = 30.0
#: How long rollouts get to finish their episode in progress after exit().
EXIT_TIMEOUT_S = 30.0


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that the same cleanup runs; exit status 143."""


class DemoError(Exception):
    """A problem with the demo's arguments or inputs: reported as ``error: ...``, exit 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
    return value


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=_positive_int, default=50,
                        help="training steps (optimizer steps on trainer 0; default 50)")
    parser.add_argument("--duration", type=_positive_float, default=None, metavar="SECONDS",
                        help="stop training after this many seconds even if --steps are not done")
    parser.add_argument("--rollouts", type=_positive_int, default=None, metavar="N",
                        help="rollout workers (default 2, or as many as --placement places)")
    parser.add_argument("--trainers", type=_positive_int, default=None, metavar="M",
                        help="trainer workers (default 2, or as many as --placement places)")
    parser.add_argument("--batch-weight", type=_positive_float, default=512.0, metavar="W",
                        help="env steps per trainer batch: get_batch(W) (default 512)")
    parser.add_argument("--placement", metavar="FILE.yaml", default=None,
                        help="config whose cluster.component_placement places the components "
                             "'rollout' and 'trainer' (and whose cluster.num_nodes sizes an "
                             "embedded cluster)")
    parser.add_argument("--registry", metavar="tcp://HOST:PORT", default=None,
                        help="run on an existing cluster (attach mode) instead of an embedded one")
    parser.add_argument("--key-file", metavar="FILE", default=None,
                        help="with --registry: the cluster's key file (default: $AIORL_KEY_FILE)")
    parser.add_argument("--num-nodes", type=_positive_int, default=None, metavar="K",
                        help="nodes: started locally in embedded mode, awaited in attach mode "
                             "(default: cluster.num_nodes of --placement, else 1)")
    parser.add_argument("--max-len", type=_positive_int, default=200, metavar="T",
                        help="longest episode in env steps (default 200)")
    parser.add_argument("--queue-size", type=_positive_int, default=16, metavar="Q",
                        help="channel capacity in trajectories; rollouts wait when it is full "
                             "(default 16)")
    parser.add_argument("--hidden", type=_positive_int, default=64,
                        help="hidden units of the policy MLP (default 64)")
    parser.add_argument("--lr", type=_positive_float, default=3e-3,
                        help="Adam learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--plain", action="store_true",
                        help="print one line per step even on a terminal (no live view)")


def add_parser(subparsers: Any) -> None:
    """Add the ``demo`` subcommand to an ``argparse`` subparsers object (``func=run``)."""
    parser = subparsers.add_parser("demo", help="run a small distributed RL job and watch it",
                                   description=_DESCRIPTION)
    _add_arguments(parser)
    parser.set_defaults(func=run)


# ---------------------------------------------------------------------- placement
@dataclass
class _Plan:
    """Where the groups go: strategies (None = spread over the nodes) and sizes."""

    cluster_cfg: dict[str, Any] | None
    num_rollouts: int
    num_trainers: int
    num_nodes: int | None
    from_file: bool


def _load_placement(path: str) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        raw = OmegaConf.load(path)
    except OSError as exc:
        raise DemoError(f"cannot read {path}: {exc}") from None
    except OmegaConfBaseException as exc:
        raise DemoError(f"cannot read {path}: {exc}") from None
    except Exception as exc:  # YAML syntax errors come from PyYAML with many types
        raise DemoError(f"cannot parse {path}: {exc}") from None
    cfg = OmegaConf.to_container(raw, resolve=True)
    if not isinstance(cfg, dict):
        raise DemoError(f"{path}: expected a mapping with a cluster: section")
    # YAML allows non-string keys (`1:`, `true:`); the placement schema has string keys
    # only, so any other key is reported by its text as unknown further on.
    return {str(key): value for key, value in cfg.items()}


def _plan(args: argparse.Namespace) -> _Plan:
    """Check the placement (if any) before anything starts; sizes of both groups."""
    if args.placement is None:
        return _Plan(None, args.rollouts or 2, args.trainers or 2, args.num_nodes, False)

    from aiorl.placement import ClusterSpec, ComponentPlacement, PlacementError

    cfg = _load_placement(args.placement)
    section = cfg.get("cluster", cfg)
    if not isinstance(section, dict):
        raise DemoError(f"{args.placement}: cluster: must be a mapping")
    if args.registry is None:
        # Embedded: the cluster will be exactly what the file (and --num-nodes) says, so a
        # bad placement fails here, before a single process starts.
        try:
            spec = ClusterSpec.from_config(cfg, num_nodes=args.num_nodes)
            placement = ComponentPlacement(cfg, spec)
            sizes = _component_sizes(placement)
        except PlacementError as exc:
            raise PlacementError(f"{args.placement}: {exc}") from None
    else:
        sizes = None  # checked against the live cluster once attached
    plan = _Plan(cfg, 0, 0, args.num_nodes, True)
    if sizes is not None:
        plan.num_rollouts, plan.num_trainers = sizes
        _check_sizes(args, sizes)
    return plan


def _component_sizes(placement: Any) -> tuple[int, int]:
    """Processes of the rollout and trainer components.

    Raises PlacementError naming the known components if one is missing.
    """
    return placement.get_world_size(ROLLOUT_GROUP), placement.get_world_size(TRAINER_GROUP)


def _check_sizes(args: argparse.Namespace, sizes: tuple[int, int]) -> None:
    for flag, given, placed, comp in (("--rollouts", args.rollouts, sizes[0], ROLLOUT_GROUP),
                                      ("--trainers", args.trainers, sizes[1], TRAINER_GROUP)):
        if given is not None and given != placed:
            raise DemoError(f"{flag} {given} disagrees with {args.placement}, which places "
                            f"{placed} process(es) for component {comp!r}")


def _strategies(plan: _Plan, cluster: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    """Placement strategies for the rollout and trainer groups on the live cluster."""
    from aiorl.placement import ComponentPlacement, NodePlacementStrategy

    if plan.from_file:
        placement = ComponentPlacement(plan.cluster_cfg, cluster)
        sizes = _component_sizes(placement)
        _check_sizes(args, sizes)
        plan.num_rollouts, plan.num_trainers = sizes
        return placement.get_strategy(ROLLOUT_GROUP), placement.get_strategy(TRAINER_GROUP)
    nodes = max(1, cluster.num_nodes)

    def spread(n: int) -> Any:
        # Evenly over the nodes, in node order: CPU-only workers, no accelerators needed.
        return NodePlacementStrategy(sorted(i % nodes for i in range(n)))

    return spread(plan.num_rollouts), spread(plan.num_trainers)


# ---------------------------------------------------------------------- the job
@dataclass
class _Job:
    """Everything the demo started, so that cleanup can stop exactly that."""

    cluster: Any = None
    trainers: Any = None
    rollouts: Any = None
    channel: Any = None
    works: list[Any] = field(default_factory=list)  # long calls (run, train) in flight
    history: list[dict[str, Any]] = field(default_factory=list)


def _demo_config(args: argparse.Namespace, plan: _Plan) -> dict[str, Any]:
    return {
        "channel": CHANNEL_NAME,
        "rollout_group": ROLLOUT_GROUP,
        "trainer_group": TRAINER_GROUP,
        "num_rollouts": plan.num_rollouts,
        "num_trainers": plan.num_trainers,
        "steps": args.steps,
        "batch_weight": args.batch_weight,
        "max_len": args.max_len,
        "hidden": args.hidden,
        "lr": args.lr,
        "gamma": 0.99,
        "seed": args.seed,
        "torch_threads": 1,
    }


def _snapshot(job: _Job, t0: float, target: int, since: int) -> tuple[Any, list[dict[str, Any]]]:
    """Ask every worker and the channel how things stand (one round trip each)."""
    from aiorl.demo.display import Snapshot, WorkerRow

    r_work = job.rollouts.stats()
    t_work = job.trainers.status(since)
    q_work = job.channel.statistics()
    rollouts = r_work.wait(STATS_TIMEOUT_S)
    trainers = t_work.wait(STATS_TIMEOUT_S)
    queues = q_work.wait(STATS_TIMEOUT_S)
    return _build_snapshot(Snapshot, WorkerRow, rollouts, trainers, queues,
                           time.monotonic() - t0, target, job.history)


def _build_snapshot(snapshot_cls: Any, row_cls: Any, rollouts: list[dict[str, Any]],
                    trainers: list[dict[str, Any]], queues: dict[str, Any], elapsed: float,
                    target: int, history: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
    new = list(trainers[0]["history"])
    history.extend(new)
    rows = []
    for i, s in enumerate(rollouts):
        rows.append(row_cls(
            name=f"{ROLLOUT_GROUP}:{i}", node=s.get("node_rank", "-"), role="rollout",
            state=s["state"], activity=s.get("activity", "-"), version=int(s.get("version", 0)),
            items=int(s.get("trajectories", 0)), env_steps=int(s.get("env_steps", 0)),
            nbytes=int(s.get("bytes", 0)),
            extra=f"put wait {s.get('put_wait_s', 0.0):.2f} s, "
                  f"{s.get('weights_received', 0)} weight updates"))
    for t in trainers:
        rows.append(row_cls(
            name=f"{TRAINER_GROUP}:{t['rank']}", node=t["node_rank"], role="trainer",
            state="training" if t["activity"] != "done" else "done", activity=t["activity"],
            version=int(t["version"]), items=int(t["trajectories"]),
            env_steps=int(t["env_steps"]), nbytes=int(t["bytes"]),
            extra=f"{t['steps']} batches"
                  + (", owns the weights" if t["rank"] == 0 else ", sends gradients")))
    default = queues.get("default")
    snap = snapshot_cls(
        elapsed=elapsed,
        steps=len(history),
        target=target,
        version=int(trainers[0]["version"]),
        produced_items=sum(int(s.get("trajectories", 0)) for s in rollouts),
        produced_bytes=sum(int(s.get("bytes", 0)) for s in rollouts),
        consumed_items=sum(int(t["trajectories"]) for t in trainers),
        consumed_bytes=sum(int(t["bytes"]) for t in trainers),
        weights_bytes=int(trainers[0]["weights_bytes_sent"]),
        queue_items=int(default.qsize) if default is not None else 0,
        queue_weight=float(default.weight) if default is not None else 0.0,
        last_step=history[-1] if history else None,
        workers=rows,
    )
    return snap, new


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so the cleanup below runs for it too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _uninterruptible() -> Iterator[None]:
    """Ignore Ctrl-C/SIGTERM while cleaning up: a second Ctrl-C must not strand processes.

    Every step of the cleanup has its own timeout, so this cannot hang for long.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _close(job: _Job, say: Any) -> None:
    """Stop everything the demo started: channel, groups, then the cluster."""
    with _uninterruptible():
        if job.channel is not None and job.cluster is not None and not job.cluster.embedded:
            # Attach mode: the channel worker is a group of its own on a shared cluster.
            try:
                job.channel.destroy().wait(10)
            except Exception as exc:
                say(f"warning: could not destroy channel {CHANNEL_NAME!r}: {exc}")
        for group in (job.rollouts, job.trainers):
            if group is not None:
                group.close()
        if job.cluster is not None:
            job.cluster.close()
        for work in job.works:
            # Interrupted calls fail with PeerLostError when their groups close; reading the
            # error keeps asyncio from reporting it as never retrieved.
            if work.done():
                work.exception()


def _drive(args: argparse.Namespace, plan: _Plan, job: _Job, display: Any) -> int:
    """Start the cluster and the groups, train, show progress, print the summary."""
    import aiorl
    from aiorl.channels import Channel
    from aiorl.demo.display import summary_text
    from aiorl.demo.workers import RolloutWorker, TrainerWorker

    wall0 = time.monotonic()
    say = display.message
    mode = f"attaching to {args.registry}" if args.registry else "starting an embedded cluster"
    say(f"aiorl demo: {mode} ...")
    job.cluster = aiorl.Cluster(plan.cluster_cfg, registry=args.registry,
                                num_nodes=plan.num_nodes, key_file=args.key_file)
    r_strategy, t_strategy = _strategies(plan, job.cluster, args)
    cfg = _demo_config(args, plan)
    say(f"cluster ready in {time.monotonic() - wall0:.1f} s: {job.cluster.num_nodes} node(s), "
        f"registry {job.cluster.registry_address}")
    say(f"launching {plan.num_trainers} trainer(s), {plan.num_rollouts} rollout worker(s) and "
        f"channel {CHANNEL_NAME!r} (batch weight {args.batch_weight:g} env steps, "
        f"capacity {args.queue_size} trajectories) ...")
    job.trainers = TrainerWorker.create_group(cfg).launch(
        job.cluster, t_strategy, name=TRAINER_GROUP)
    job.rollouts = RolloutWorker.create_group().launch(
        job.cluster, r_strategy, name=ROLLOUT_GROUP)
    # Hosted on trainer 0's node: trajectories cross the network once, toward the consumers.
    # (node_rank rather than group_affinity: the node is known from the plan, so the channel
    # starts alongside the groups instead of waiting for trainer 0 to be ready.)
    trainer0_node = t_strategy.get_placement(job.cluster.spec)[0].node_rank
    job.channel = Channel.create(job.cluster, CHANNEL_NAME, maxsize=args.queue_size,
                                 node_rank=trainer0_node)
    job.trainers.wait_ready(120)
    # Trainers first, so that they wait for the first trajectories rather than the
    # rollouts filling the channel while the trainers are still getting ready.
    t0 = time.monotonic()
    train_work = job.trainers.train()
    job.works.append(train_work)
    job.rollouts.configure(cfg)
    run_work = job.rollouts.run()
    job.works.append(run_work)
    job.rollouts.start().wait(120)
    say(f"workers ready in {time.monotonic() - wall0:.1f} s; training for {args.steps} steps"
        + (f" (at most {args.duration:g} s)" if args.duration else ""))
    finished = threading.Event()
    # (then() runs only on success; a failure is noticed by the done() checks below.)
    job.works.append(train_work.then(lambda _: finished.set()))
    stopped_early: str | None = None
    snap = None
    while True:
        snap, new = _snapshot(job, t0, args.steps, len(job.history))
        display.update(snap, new)
        if train_work.done():
            break
        if run_work.done():
            run_work.wait()  # a rollout failed: raise its RemoteError
            raise RuntimeError("the rollout workers stopped before training was done")
        if (args.duration is not None and stopped_early is None
                and time.monotonic() - t0 >= args.duration):
            stopped_early = f"--duration {args.duration:g} s reached"
            job.trainers.execute_on(0).request_stop()
        finished.wait(REFRESH_S)
    train_s = time.monotonic() - t0
    train_results = train_work.wait()  # raises a trainer's RemoteError
    job.rollouts.exit().wait(EXIT_TIMEOUT_S)
    finals = run_work.wait(EXIT_TIMEOUT_S)
    # One last look, once rank 0's history is complete and every rollout's exit() has
    # asked the weights directory for the newest version: a look taken earlier can miss
    # the final version's announcement, still on its way to a rollout's listener.
    snap, new = _snapshot(job, t0, args.steps, len(job.history))
    display.update(snap, new)
    display.close()
    totals = {
        "env_steps": sum(int(f.get("env_steps", 0)) for f in finals),
        "put_wait_s": sum(float(f.get("put_wait_s", 0.0)) for f in finals),
        "dropped": sum(int(f.get("dropped", 0)) for f in finals),
    }
    first_length = job.history[0]["mean_length"] if job.history else None
    assert snap is not None
    snap.version = int(train_results[0]["version"])
    print(summary_text(snap, wall_s=time.monotonic() - wall0, train_s=train_s,
                       first_length=first_length, stopped_early=stopped_early,
                       rollout_totals=totals), flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the demo; return its exit status.

    0: done; 1: a runtime failure (a worker raised or died, a timeout); 2: bad arguments or
    an invalid placement; 130: Ctrl-C; 143: SIGTERM. Every path closes what was started.
    """
    from aiorl.demo.display import LineDisplay, make_display
    from aiorl.errors import AiorlError, PlacementError

    try:
        plan = _plan(args)
    except (DemoError, PlacementError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    display = LineDisplay(sys.stdout) if args.plain else make_display(sys.stdout)
    job = _Job()
    code = 1
    try:
        with _sigterm_as_interrupt():
            try:
                code = _drive(args, plan, job, display)
            except KeyboardInterrupt as exc:
                display.close()
                what = "terminated" if isinstance(exc, _Terminated) else "interrupted"
                print(f"\naiorl demo: {what}; stopping the workers and the cluster ...",
                      file=sys.stderr, flush=True)
                code = 143 if isinstance(exc, _Terminated) else 130
            except (DemoError, PlacementError) as exc:
                display.close()
                print(f"error: {exc}", file=sys.stderr)
                code = 2
            except (AiorlError, TimeoutError, RuntimeError, ValueError, OSError) as exc:
                display.close()
                print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
                code = 1
            finally:
                display.close()
                _close(job, lambda text: print(text, file=sys.stderr))
    except KeyboardInterrupt as exc:
        # A signal between the inner handler and the cleanup's masking: clean up anyway.
        _close(job, lambda text: print(text, file=sys.stderr))
        code = 143 if isinstance(exc, _Terminated) else 130
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point: ``python -m aiorl.cli.demo [options]``."""
    parser = argparse.ArgumentParser(prog="aiorl demo", description=_DESCRIPTION)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
