"""The closed loop as one Ray job: the proxy's recorded agent traffic -> traces -> fine-tune (Ray Train) ->
held-out replay and gate -> deploy into the running `dspine serve`, every --every seconds.

    ray job submit --working-dir . -- python adapt/loop.py --store runs/proxy.db --work runs/loop \\
        --endpoint http://127.0.0.1:8000 --admin-key K --every 3600 --iterations 0 \\
        finetune.workers=2 finetune.per=workload finetune.train.steps=400 evaluate.limit=2

Settings: LoopConfig (adapt/cycle.py) with its finetune / evaluate / deploy sections as dotted overrides.
Each iteration's outcome goes to WORK/loop.json, every deploy decision to WORK/deploys.jsonl.
"""

import argparse
import json
import os
import sys


def parse(argv=None):
    from dspine.adapt.cycle import LoopConfig
    from dspine.config import configure

    p = argparse.ArgumentParser(
        prog="adapt/loop.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--store", required=True, help="the proxy's SQLite store (dspine proxy --db)")
    p.add_argument("--work", required=True, help="folder for the iterations, loop.json and deploys.jsonl")
    p.add_argument("--endpoint", default="http://127.0.0.1:8000", help="the dspine server (default: %(default)s)")
    p.add_argument("--admin-key", default=os.environ.get("DSPINE_ADMIN_KEY", ""), help="(default: $DSPINE_ADMIN_KEY)")
    p.add_argument("--base", default="builtin", help="the drafter every iteration adapts (default: builtin)")
    p.add_argument("--every", type=float, default=3600.0, help="seconds from one iteration's start to the next")
    p.add_argument("--iterations", type=int, default=1, help="how many (0: until stopped)")
    p.add_argument("overrides", nargs="*", help="dotted settings, e.g. finetune.workers=2 evaluate.limit=1")
    a = p.parse_args(argv)
    return configure(
        LoopConfig,
        a.overrides,
        store=a.store,
        work=a.work,
        every_s=a.every,
        iterations=a.iterations,
        deploy={"endpoint": a.endpoint, "admin_key": a.admin_key},
        finetune={"base": a.base},
    )


def main(argv=None) -> int:
    from dspine.adapt.cycle import run_loop
    from dspine.adapt.deployment import DeployError
    from dspine.adapt.finetuning import FinetuneError
    from dspine.checkpoint import CheckpointError
    from dspine.config import ConfigError

    try:
        done = run_loop(parse(argv))
    except (ConfigError, FinetuneError, CheckpointError, DeployError) as e:
        print(f"loop: error: {e}", file=sys.stderr)
        return 2
    for d in done:
        print(json.dumps({k: d.get(k) for k in ("iteration", "action", "rows_total", "per_cell", "deploys")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
