"""The pieces behind ``aiorl demo``: a toy RL job that exercises every part of aiorl.

* :mod:`aiorl.demo.rl`: a CartPole environment written in torch, an MLP policy and the
  REINFORCE loss (imports torch; used only inside worker processes);
* :mod:`aiorl.demo.workers`: the rollout workers (:class:`~aiorl.PollingWorker`) and the
  trainer workers that the demo launches;
* :mod:`aiorl.demo.display`: the live terminal view and the final summary.

The command itself is :mod:`aiorl.cli.demo`; the walk-through is ``docs/demo.md``.
Nothing here is imported by ``import aiorl``.
"""
