"""`dspine` command line: one module per verb family, each parser beside its handler; entry points only parse and
call the library.

    generate          cli/generate.py
    regen, traces     cli/data.py
    train, export     cli/train.py
    serve, proxy,     cli/serve.py
    dashboard
    bench, eval       cli/bench.py
"""

from __future__ import annotations

import argparse
import sys

from dspine.cli import bench, data, generate, serve, train
from dspine.cli.bench import _draft_lens  # noqa: F401  (tests parse the mini-language directly)
from dspine.cli.common import UsageError, dtype_tag, engine_from_args

__all__ = ["UsageError", "dtype_tag", "engine_from_args", "main"]

# verb -> (adds its parser, runs it)
VERBS = {
    "generate": (generate.add_generate, generate.cmd_generate),
    "regen": (data.add_regen, data.cmd_regen),
    "train": (train.add_train, train.cmd_train),
    "serve": (serve.add_serve, serve.cmd_serve),
    "proxy": (serve.add_proxy, serve.cmd_proxy),
    "dashboard": (serve.add_dashboard, serve.cmd_dashboard),
    "export": (train.add_export, train.cmd_export),
    "traces": (data.add_traces, data.cmd_traces),
    "bench": (bench.add_bench, bench.cmd_bench),
    "eval": (bench.add_eval, bench.cmd_eval),
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dspine", description="Train and serve DSpine speculative-decoding drafters.")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="VERB")
    for add, _ in VERBS.values():
        add(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from dspine.checkpoint import CheckpointError
    from dspine.config import ConfigError
    from dspine.sampling import RequestError
    from dspine.target import TargetError
    from dspine.train.data import RegenError

    ap = parser()
    a, rest = ap.parse_known_args(argv)
    # dotted overrides may come after later options (argparse stops collecting positionals there)
    extra = [r for r in rest if "=" in r and not r.startswith("-")]
    if len(extra) != len(rest) or (extra and not hasattr(a, "overrides")):
        ap.error(
            f"unrecognized arguments: {' '.join(r for r in rest if r not in extra or not hasattr(a, 'overrides'))}"
        )
    if extra:
        a.overrides += extra
    try:
        return VERBS[a.verb][1](a)
    except (CheckpointError, ConfigError, RequestError, TargetError, UsageError, RegenError) as e:
        print(f"dspine {a.verb}: error: {e}", file=sys.stderr)
        return 2
