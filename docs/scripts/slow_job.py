"""The slow job of docs/debugging.md ("A slow job, explained with a trace"), traced.

Four rollout ranks feed one trainer each step; rank 3 is five times slower than the others.
Tracing is on for the whole cluster; the warm-up step's spans (and those of the launch) are
drained by a first dump, so the trace written holds exactly the steps that follow, as after
``aiorl trace start``.

Run: ``python docs/scripts/slow_job.py trace.json`` (then ``python
docs/scripts/render_trace.py trace.json -o docs/img/trace.png`` draws it, or open it in
ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import aiorl

RANKS = 4


class Rollout(aiorl.Worker):
    def generate(self, step: int) -> None:
        with aiorl.span("rollout.generate", step=step):
            time.sleep(0.25 if self.rank == 3 else 0.05)  # (rank 3 is the slow one)
        self.send({"step": step, "rank": self.rank}, "trainer", 0).wait()


class Trainer(aiorl.Worker):
    def train(self, step: int, ranks: int) -> int:
        batch = [self.recv("rollout", r).wait() for r in range(ranks)]
        with aiorl.span("trainer.update", step=step):
            time.sleep(0.02)
        return len(batch)


def run(path: str, steps: int = 3) -> dict[str, int]:
    """Run a warm-up step and ``steps`` traced steps; write their trace to ``path``.

    Returns the counts the ``aiorl trace dump`` command prints: spans and processes.
    """
    with aiorl.Cluster(trace=True) as cluster:
        rollout = Rollout.create_group().launch(cluster, num_workers=RANKS, name="rollout")
        trainer = Trainer.create_group().launch(cluster, name="trainer")
        try:
            for step in range(steps + 1):
                if step == 1:  # forget the launch and the warm-up, keep the steps
                    with tempfile.TemporaryDirectory() as scratch:
                        cluster.trace_dump(os.path.join(scratch, "warm-up.json"))
                train = trainer.train(step, RANKS)
                rollout.generate(step).wait(60)
                assert train.wait(60) == [RANKS]
            cluster.trace_dump(path)
        finally:
            rollout.close()
            trainer.close()
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    spans = sum(1 for e in events if e["ph"] == "b" or (e["ph"] == "X" and e["dur"] > 0))
    return {"spans": spans, "processes": int(trace["otherData"]["processes"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="where to write the Chrome/Perfetto trace (JSON)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    counts = run(args.output, args.steps)
    print(f"wrote {args.output}: {counts['spans']} spans from {counts['processes']} processes")


if __name__ == "__main__":
    main()
