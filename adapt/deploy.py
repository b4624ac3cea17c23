"""Deploy an adapted drafter that passed adapt/evaluate.py's gate into a running `dspine serve` (started with
--admin-key): swap without dropping requests, check live acceptance, roll back when it falls short.

    python adapt/deploy.py --evaluation bench/results/adapt.json --endpoint http://127.0.0.1:8000 --admin-key K

Exit 0: deployed; 3: refused by the gate or rolled back after the live check; 2: bad input or a server that
refused the swap (the old drafter keeps serving). Every decision is appended to the history (JSON lines,
default deploys.jsonl beside the evaluation). A group adapted to one workload ("tool", or "tool-high" per
thinking level) is deployed to that workload's route only (the server keeps its default drafter for the rest);
the group "all" replaces the default; `route=default` or `route=WORKLOAD[/LEVEL]` says otherwise. Settings:
DeployConfig (adapt/deployment.py) as dotted overrides, e.g. `live_requests=6 live_tolerance=0.9`.

SGLang (its draft model is fixed at launch) is deployed to by restarting it with the adapted drafter, exported:

    python adapt/deploy.py --evaluation adapt.json --endpoint http://127.0.0.1:30000 export=sglang \
        restart="python -m sglang.launch_server --model-path T --speculative-algorithm DFLASH \
                 --speculative-draft-model-path {drafter} --host 127.0.0.1 --port {port} ..."

deploy stops the server it started last (state=, default backend.json beside the history), starts this one,
checks live τ from SGLang's own counts, and on a failed start or a τ that falls short starts the previous again.
"""

import argparse
import json
import os
import sys


def parse(argv=None):
    from dspine.adapt.deployment import DeployConfig
    from dspine.config import configure

    p = argparse.ArgumentParser(
        prog="adapt/deploy.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--evaluation", required=True, help="adapt/evaluate.py's JSON (with the gate's decision)")
    p.add_argument("--group", default="", help="which adapted drafter (default: the only one)")
    p.add_argument("--endpoint", default="http://127.0.0.1:8000", help="the dspine server (default: %(default)s)")
    p.add_argument("--admin-key", default=os.environ.get("DSPINE_ADMIN_KEY", ""), help="(default: $DSPINE_ADMIN_KEY)")
    p.add_argument(
        "--read-key",
        default=os.environ.get("DSPINE_READ_KEY", ""),
        help="the server's read key, for its records; a restarted backend gets it as DSPINE_READ_KEY "
        "(default: $DSPINE_READ_KEY, else the admin key)",
    )
    p.add_argument("--history", default="", help="JSON lines of decisions (default: deploys.jsonl beside --evaluation)")
    p.add_argument("overrides", nargs="*", help="dotted settings, e.g. live_requests=6")
    a = p.parse_args(argv)
    return configure(
        DeployConfig,
        a.overrides,
        evaluation=a.evaluation,
        group=a.group,
        endpoint=a.endpoint,
        admin_key=a.admin_key,
        read_key=a.read_key,
        history=a.history,
    )


def main(argv=None) -> int:
    from dspine.adapt.deployment import DeployError, deploy
    from dspine.config import ConfigError

    try:
        entry = deploy(parse(argv))
    except (ConfigError, DeployError, OSError, ValueError) as e:
        print(f"deploy: error: {e}", file=sys.stderr)
        return 2
    keys = ("action", "group", "route", "drafter", "gated_tau", "live", "reasons")
    print(json.dumps({k: entry.get(k) for k in keys}))
    return 0 if entry["action"] == "deployed" else 3


if __name__ == "__main__":
    sys.exit(main())
