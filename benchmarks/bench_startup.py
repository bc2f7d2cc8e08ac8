"""What a user's first ``Cluster()`` and first group cost, on this machine.

Each run is a fresh interpreter (nothing cached in the process), timing:

* ``import torch`` alone (the floor: every zygote pays it once);
* ``Cluster()`` ready (embedded: a registry and one node agent started and joined);
* the first group of one worker, launch to its first answer (cold: it waits for the zygote's
  own ``import torch`` unless that finished while the program did other things);
* the next group, eight workers (warm: forked from the ready zygote).

Prints the median and range of each over ``--runs`` runs, with the machine (cores, Python,
torch and its build: a CUDA build imports more libraries, and on a GPU machine the driver
adds its own start-up), so CPU and GPU machines can be compared side by side::

    python benchmarks/bench_startup.py --runs 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""\
    import json, time
    started = time.perf_counter()
    import torch
    torch_s = time.perf_counter() - started
    import aiorl

    class Probe(aiorl.Worker):
        def ping(self):
            return 1

    begin = time.perf_counter()
    with aiorl.Cluster() as cluster:
        ready = time.perf_counter()
        Probe.create_group().launch(cluster, num_workers=1, name="first").ping().wait(300)
        first = time.perf_counter()
        Probe.create_group().launch(cluster, num_workers=8, name="next").ping().wait(300)
        warm = time.perf_counter()
    print(json.dumps({"import torch": torch_s, "Cluster() ready": ready - begin,
                      "first group (1 worker), cold": first - ready,
                      "next group (8 workers), warm": warm - first}))
    """)

MACHINE = textwrap.dedent("""\
    import json, os, platform, torch
    print(json.dumps({"python": platform.python_version(), "cores": os.cpu_count(),
                      "torch": torch.__version__, "cuda build": torch.version.cuda,
                      "cuda devices": torch.cuda.device_count()}))
    """)


def _run(code: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "AIORL_REGISTRY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env=env, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", help="also write the samples and the machine here")
    args = parser.parse_args()
    machine = _run(MACHINE)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), flush=True)
    samples: dict[str, list[float]] = {}
    for i in range(args.runs):
        for name, seconds in _run(PROBE).items():
            samples.setdefault(name, []).append(seconds)
        print(f"run {i + 1}/{args.runs} done", file=sys.stderr, flush=True)
    print(f"\n{'':34} {'median':>8} {'range':>15}   ({args.runs} runs)")
    for name, values in samples.items():
        print(f"{name:34} {statistics.median(values):7.2f}s "
              f"{min(values):6.2f}-{max(values):5.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
