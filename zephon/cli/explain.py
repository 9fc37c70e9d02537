"""``zephon explain CONFIG``: the compiled plan of a pipeline config file (see ``zephon.pipeline.config``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from ..pipeline.config import load_pipeline_config

    given = ""
    try:
        pipe = load_pipeline_config(args.config)
        if args.dp_degree is not None:
            pipe = pipe.options(dp_degree=args.dp_degree, dp_rank=args.dp_rank)
        if args.workers is not None:
            pipe = pipe.options(workers=args.workers)
        if args.dp_degree is not None:  # a message from here on is iteration's, for these flags
            given = f"--dp-degree {args.dp_degree} --dp-rank {args.dp_rank}: "
        explanation = pipe.explain(measure=args.measure)
    except (OSError, ValueError, TypeError, ImportError) as exc:
        print(f"zephon explain: {given}{exc}", file=sys.stderr)
        return 2
    print(json.dumps(explanation.to_dict(), indent=1, default=str) if args.json else explanation)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="print the compiled plan of a pipeline config: operators, settings, lanes, ranks, executor, checkpoint size",
        description="Print what a pipeline config compiles to: each operator's data and performance settings, the lanes "
        "and the ranks that own them, the executor layout, and what a checkpoint holds and its size.",
    )
    p.add_argument("config", help="a pipeline config file (.toml or .json; see docs/guide/observability.md)")
    p.add_argument("--measure", type=int, default=0, metavar="N", help="run lane 0 for N outputs to measure the checkpoint size (default 0: no run)")
    p.add_argument("--dp-degree", type=int, help="explain for this many data-parallel ranks (default: from the environment, else 1)")
    p.add_argument("--dp-rank", type=int, default=0, help="the rank to explain with --dp-degree (default 0)")
    p.add_argument("--workers", type=int, help="override the config's worker processes")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_run)
