"""The pieces behind ``aiorl demo``: a toy RL job that exercises every part of aiorl.

* `aiorl.demo.rl`: a CartPole environment written in torch, an MLP policy and the
  REINFORCE loss (imports torch; used only inside worker processes);
* `aiorl.demo.workers`: the rollout workers ([`PollingWorker`][aiorl.PollingWorker]) and the
  trainer workers that the demo launches;
* `aiorl.demo.display`: the live terminal view and the final summary.

The command itself is `aiorl.cli.demo`; the walk-through is ``docs/demo.md``.
Nothing here is imported by ``import aiorl``.
"""
