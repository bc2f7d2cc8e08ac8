"""The two kinds of workers that ``aiorl demo`` launches.

Data flow (``docs/demo.md`` has the diagram)::

    rollout:r --put(trajectory, weight=len)--> channel --get_batch(w)--> trainer:t
    trainer:t (t > 0) --send(gradients)--> trainer:0
    trainer:0 --publish(weights, version)--> "policy" (aiorl.weights)
    every trainer:t (t > 0) and every rollout:r --pull("policy")--> its own policy

* `RolloutWorker` is a [`PollingWorker`][aiorl.PollingWorker]: each poll plays one CartPole
  episode with its current policy and puts the trajectory into the channel with
  ``weight`` = its length. A background task on the worker's event loop waits for a new
  weight version (``wait_for``) and flags it; the poll thread pulls the newest version
  into the policy before its next episode: generation never waits for weights, and a
  rollout that fell behind skips straight to the newest version.
* `TrainerWorker` runs `TrainerWorker.train`: take a batch with
  ``get_batch(batch_weight)``, compute the REINFORCE gradients, average them on rank 0
  (P2P), take an Adam step there and publish the new version once (shared memory on its
  node, one relay per other node); every other trainer pulls it before its next step.
  Synchronous data parallelism with rank 0 as the source of truth.

torch is imported lazily (inside methods): the driver imports this module to name the
classes and must stay light; worker processes have torch preloaded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from aiorl.actors.polling import PollingWorker, PollResult
from aiorl.actors.worker import Worker
from aiorl.errors import PeerLostError

__all__ = ["DemoConfig", "RolloutWorker", "TrainerWorker"]

log = logging.getLogger("aiorl.demo")

#: The demo's configuration, a plain dict shipped to every worker (see ``aiorl.cli.demo``):
#: channel, rollout_group, trainer_group, num_rollouts, num_trainers, steps, batch_weight,
#: max_len, hidden, lr, gamma, seed, torch_threads.
DemoConfig = Mapping[str, Any]

#: How often a poll blocked on a full channel checks whether it should give up (exit()).
_PUT_CHECK_S = 0.1
#: The weight name trainer 0 publishes under (the demo's one policy).
WEIGHTS = "policy"


def _set_torch_threads(cfg: DemoConfig) -> None:
    import torch

    # The demo's tensors are tiny; several workers share a few cores, and one intra-op
    # thread each avoids oversubscribing them.
    torch.set_num_threads(int(cfg.get("torch_threads", 1)))


class RolloutWorker(PollingWorker):
    """Generates CartPole trajectories with the newest policy and puts them in the channel.

    Configure with the demo config (`DemoConfig`). Extra stats (``stats()``):
    ``activity`` (``generating``, ``waiting for room`` -- the previous trajectory is not yet
    accepted by the channel --, ``loading weights`` or ``idle``), ``version`` (the weight
    version in use), ``trajectories``, ``env_steps`` and ``bytes`` (accepted by the channel),
    ``dropped`` (given up at exit), ``put_wait_s`` (time spent waiting for room:
    backpressure), ``weights_received``, ``weights_bytes``, ``weights_listener`` and
    ``mean_length`` (of the last 20 accepted episodes).
    """

    def __init__(self) -> None:
        super().__init__()
        self._cfg: DemoConfig = {}
        self._new_version = threading.Event()  # set by the listener, cleared by the poll thread
        self._give_up = threading.Event()  # set by exit(): a poll blocked on a full channel ends
        self._last_put: tuple[Any, threading.Event] | None = None  # the put not yet waited for
        self._listener: asyncio.Task[None] | None = None
        self._activity = "idle"
        self._version = 0
        self._trajectories = 0
        self._env_steps = 0
        self._bytes = 0
        self._dropped = 0
        self._put_wait_s = 0.0
        self._weights_received = 0
        self._weights_bytes = 0
        self._listener_state = "waiting"
        self._recent: deque[int] = deque(maxlen=20)

    # ------------------------------------------------------------------ lifecycle hooks
    async def _configure(self, config: DemoConfig) -> None:
        """Build the policy and environment and start listening for weights (event loop)."""
        # async: the listener task must be created on the event loop, and building a tiny
        # MLP is quick enough to do here.
        import torch

        from aiorl.demo import rl

        cfg = dict(config)
        self._cfg = cfg
        _set_torch_threads(cfg)
        self._policy = rl.make_policy(int(cfg["hidden"]), int(cfg["seed"]))
        self._gen = torch.Generator().manual_seed(int(cfg["seed"]) * 1000 + 17 * self.rank + 1)
        self._env = rl.CartPole(self._gen)
        self._rl = rl
        # On the event loop this returns at once; the first put waits for readiness.
        self._channel = self.connect_channel(str(cfg["channel"]))
        self._weights = self.weight_subscriber(WEIGHTS)
        self._listener = asyncio.get_running_loop().create_task(self._listen_for_weights())

    def _poll(self) -> PollResult:
        """Play one episode and put it in the channel (poll thread).

        The put is pipelined: the poll waits for the *previous* trajectory to be accepted
        (which is where backpressure from a full channel stops generation), then issues
        this one's put and returns, so the put's round trip overlaps the next episode.
        """
        self._load_newest_weights()
        self._activity = "generating"
        traj: dict[str, Any] = self._rl.rollout_episode(
            self._policy, self._env, int(self._cfg["max_len"]), self._gen)
        length = int(traj["obs"].shape[0])
        traj["version"] = self._version
        traj["rollout"] = self.rank
        if self._last_put is not None:
            self._activity = "waiting for room"
            t0 = time.monotonic()
            accepted = self._wait_accepted(*self._last_put)
            self._put_wait_s += time.monotonic() - t0
            self._last_put = None
            if not accepted:  # exiting: this trajectory is dropped too
                self._dropped += 1
                self._activity = "idle"
                return PollResult()
        self._issue_put(traj, length, self._rl.trajectory_nbytes(traj))
        self._activity = "idle"
        return PollResult(sample_count=length, batch_count=1)

    def _stats(self) -> dict[str, Any]:
        recent = list(self._recent)
        return {
            "activity": self._activity,
            "version": self._version,
            "trajectories": self._trajectories,
            "env_steps": self._env_steps,
            "bytes": self._bytes,
            "dropped": self._dropped,
            "put_wait_s": self._put_wait_s,
            "weights_received": self._weights_received,
            "weights_bytes": self._weights_bytes,
            "weights_listener": self._listener_state,
            "mean_length": sum(recent) / len(recent) if recent else 0.0,
            "node_rank": int(self.worker_info.node_rank),
        }

    async def exit(self) -> None:
        """Stop for good; a poll waiting for room in the channel drops its trajectory."""
        self._give_up.set()
        await super().exit()
        if self._listener is not None and not self._listener.done():
            self._listener.cancel()
        # The final report counts every version published, including one announced a
        # moment ago: ask the directory rather than trust the listener's last news.
        try:
            self._weights_received = await self._weights.refresh() or 0
        except PeerLostError as exc:  # the report keeps the listener's last news
            log.warning("%s: could not ask the weights directory for the final report: %s",
                        self.worker_name, exc)

    # ------------------------------------------------------------------ internals
    def _issue_put(self, traj: dict[str, Any], length: int, nbytes: int) -> None:
        """Put ``traj`` without waiting; counted once the channel has accepted it."""
        accepted = threading.Event()

        def on_accepted(_: Any) -> None:  # event loop thread, like _stats: no lock needed
            self._trajectories += 1
            self._env_steps += length
            self._bytes += nbytes
            self._recent.append(length)
            accepted.set()

        work = self._channel.put(traj, weight=length)
        work.then(on_accepted)  # only on success; failures are raised by _wait_accepted
        self._last_put = (work, accepted)

    def _wait_accepted(self, work: Any, accepted: threading.Event) -> bool:
        """Wait until the put ``work`` is accepted; False if exit() made it give up."""
        while not accepted.wait(_PUT_CHECK_S):
            if work.done():
                break
            if self._give_up.is_set() and work.cancel():
                # Withdrawn at the channel worker: the trajectory is dropped.
                self._dropped += 1
                return False
        work.wait()  # raises the put's error, if any
        return True

    def _load_newest_weights(self) -> None:
        """Pull the newest weight version into the policy, if there is a new one (poll
        thread, between episodes: the policy is not in use)."""
        if not self._new_version.is_set():
            return
        self._new_version.clear()
        self._activity = "loading weights"
        # In place, straight out of the node's shared copy of the newest complete version.
        self._version = self._weights.pull(into=self._policy.state_dict()).wait()
        self._weights_bytes = self._weights.statistics().bytes_copied

    async def _listen_for_weights(self) -> None:
        """Flag each new weight version for the poll thread until the trainer is gone."""
        self._listener_state = "listening"
        while True:
            try:
                await self._weights.wait_for(self._seen_version() + 1)
            except PeerLostError:
                self._listener_state = "trainer gone"
                return
            self._weights_received = self._seen_version()
            self._new_version.set()

    def _seen_version(self) -> int:
        return self._weights.latest_version or 0


class TrainerWorker(Worker):
    """Trains the policy on batches from the channel; rank 0 owns the weights.

    Built with the demo config (`DemoConfig`). Call `train` on every rank (it
    runs until ``steps`` optimizer steps are done or `request_stop` is called on
    rank 0); `status` answers while it runs.
    """

    def __init__(self, config: DemoConfig) -> None:
        super().__init__()
        import torch

        from aiorl.demo import rl

        self._cfg = dict(config)
        _set_torch_threads(self._cfg)
        self._rl = rl
        self._policy = rl.make_policy(int(self._cfg["hidden"]), int(self._cfg["seed"]))
        self._params = list(self._policy.parameters())
        # Built here, while the group starts, because the first torch.optim optimizer of a
        # process imports torch._dynamo (about 1.5 s of CPU) and that should not delay step 1.
        self._optimizer = (torch.optim.Adam(self._params, lr=float(self._cfg["lr"]))
                           if self.rank == 0 else None)
        self._stop_requested = False
        self._activity = "idle"
        self._version = 0
        self._steps = 0  # batches this rank trained on
        self._trajectories = 0
        self._env_steps = 0
        self._bytes = 0
        self._weights_bytes_sent = 0
        self._history: list[dict[str, Any]] = []  # rank 0: one record per optimizer step
        self._started: float | None = None

    async def request_stop(self) -> None:
        """Ask rank 0 to finish after the step in progress (other ranks follow it)."""
        self._stop_requested = True

    async def status(self, since: int = 0) -> dict[str, Any]:
        """Counters and activity now, plus the per-step records from index ``since`` on."""
        return {
            "rank": self.rank,
            "node_rank": int(self.worker_info.node_rank),
            "activity": self._activity,
            "version": self._version,
            "steps": self._steps,
            "trajectories": self._trajectories,
            "env_steps": self._env_steps,
            "bytes": self._bytes,
            "weights_bytes_sent": self._weights_bytes_sent,
            "history": self._history[since:],
            "history_len": len(self._history),
        }

    async def train(self) -> dict[str, Any]:
        """Run the training loop; returns this rank's totals (and rank 0's step history)."""
        rl = self._rl
        cfg = self._cfg
        group = self.worker_group_name
        world = self.world_size
        policy, params, optimizer = self._policy, self._params, self._optimizer
        channel = self.connect_channel(str(cfg["channel"]))
        batch_weight = float(cfg["batch_weight"])
        self._started = time.monotonic()
        while True:
            self._activity = "waiting for batch"
            batch = await channel.get_batch(batch_weight)
            self._activity = "computing gradients"
            loss, stats = rl.reinforce_loss(policy, batch, float(cfg["gamma"]), self._version)
            policy.zero_grad(set_to_none=False)
            loss.backward()
            self._account(stats)
            if self.rank != 0:
                # Gradients to rank 0, then wait for the weights it computes from them.
                self._activity = "sending gradients"
                await self.send([p.grad for p in params], group, 0)
                self._activity = "waiting for weights"
                version, final = await self.recv(group, 0)
                weights = self.weight_subscriber(WEIGHTS)
                await weights.wait_for(version)  # our view of the directory may lag a moment
                self._version = await weights.pull(into=policy.state_dict())
                if final:
                    break
                continue
            assert optimizer is not None
            if world > 1:
                self._activity = "averaging gradients"
                for src in range(1, world):
                    grads = await self.recv(group, src)
                    for p, g in zip(params, grads, strict=True):
                        # backward() filled every .grad; zero_grad(set_to_none=False) keeps it.
                        assert p.grad is not None
                        p.grad.add_(g)
                for p in params:
                    assert p.grad is not None
                    p.grad.div_(world)
            optimizer.step()
            self._version += 1
            final = self._version >= int(cfg["steps"]) or self._stop_requested
            await self._push_weights(policy, final)
            self._history.append({
                "step": self._version,
                "time": time.monotonic() - self._started,
                "loss": stats.loss,
                "mean_length": stats.mean_length,
                "trajectories": stats.trajectories,
                "env_steps": stats.env_steps,
                "staleness": stats.mean_staleness,
            })
            if final:
                break
        self._activity = "done"
        return await self.status()

    # ------------------------------------------------------------------ internals
    def _account(self, stats: Any) -> None:
        self._steps += 1
        self._trajectories += stats.trajectories
        self._env_steps += stats.env_steps
        self._bytes += stats.nbytes

    async def _push_weights(self, policy: Any, final: bool) -> None:
        """Publish the new version once (rank 0); tell the other trainers its number.

        Rollouts learn of it from the publication itself; the other trainers wait for
        the small (version, final) message because they step in lockstep with rank 0.
        """
        self._activity = "publishing weights"
        state = policy.state_dict()
        await self.weight_publisher(WEIGHTS).publish(state, self._version)
        for r in range(1, self.world_size):
            await self.send((self._version, final), self.worker_group_name, r)
        self._weights_bytes_sent += sum(v.numel() * v.element_size() for v in state.values())
