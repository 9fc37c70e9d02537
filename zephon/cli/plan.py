"""``zephon plan CONFIG --steps N [--plot out.png]``: look at a data plan before training on it."""

from __future__ import annotations

import argparse
import sys


def _run(args: argparse.Namespace) -> int:
    from ..pipeline.plan import Plan

    try:
        plan = Plan.load(args.config)
        pipeline = None
        if plan.source().needs_calibration:
            if args.tokenizer is None:
                raise ValueError(
                    "this plan counts tokens and holds no [calibration]: pass --tokenizer (a tokenizer.json) to measure "
                    "tokens per byte on its small sample, or pin them in [token_estimation] primer"
                )
            from . import tokenizer as cli
            from ..pipeline.pipeline import Pipeline

            handle = cli.load(args.tokenizer)
            pipeline = Pipeline(plan).tokenize(handle, special_tokens=cli.special_tokens(handle, args.special_tokens))
            shape = plan.steps
            if shape is None:
                raise ValueError(
                    "the plan has no [steps] table (lanes, microbatch_size[, sequence_length] or lanes, "
                    "tokens_per_microbatch, sequence_length); simulate needs it"
                )
            pipeline = pipeline.options(canonical_replicas=shape.lanes)
            if shape.sequence_length:
                pipeline = pipeline.pack_flat(shape.sequence_length)
            T = shape.tokens_per_microbatch
            rows = shape.microbatch_size if T is None else None
            pipeline = pipeline.batch(rows, tokens_per_microbatch=T)
        src = pipeline.compile().source if pipeline is not None else plan.source()
        if src.calibration is not None and plan.calibration is None:
            import attrs

            plan = attrs.evolve(plan, calibration=src.calibration)
        print(plan)
        sim = plan.simulate(args.steps, pipeline=pipeline)
        tps = None
        if src.calibration is not None:
            tps = {n: src.calibration.datasets[n].tokens_per_sample for n in src.names}
            print("calibration (tokens per sample): " + ", ".join(f"{n} {x:.1f}" for n, x in tps.items()))
        print(sim.table())
        if args.plot:
            sim.plot(args.plot, tps)
            print(f"plot written to {args.plot}")
        return 0
    except (OSError, ValueError, TypeError, ImportError) as exc:
        from .tokenizer import in_flags

        print(f"zephon plan: {in_flags(str(exc))}", file=sys.stderr)
        return 2


def register(sub) -> None:
    from .tokenizer import SPECIAL_TOKEN_CHOICES, SPECIAL_TOKENS_HELP, TOKENIZER_HELP

    p = sub.add_parser(
        "plan",
        help="print a data plan and simulate its first N global steps (samples, tokens, epochs, exhaustion per dataset)",
        description="Read a plan file (TOML or JSON: datasets, mixture or schedule, order, ends, steps) and print, per dataset, "
        "the samples and estimated tokens of the first N global steps, the epochs reached, the step where each "
        "dataset's first pass ends, and the schedule's weights over time. Reads no data beyond a calibration sample.",
    )
    p.add_argument("config", help="the plan file (.toml or .json); dataset paths are relative to its folder")
    p.add_argument("--steps", type=int, required=True, help="global steps to simulate")
    p.add_argument("--plot", default=None, help="also draw the token (or sample) shares over steps to this PNG (needs matplotlib)")
    p.add_argument(
        "--tokenizer", default=None, help=f"the tokenizer to measure tokens per byte with, for a token plan without [calibration]: {TOKENIZER_HELP}"
    )
    p.add_argument("--special-tokens", default=None, choices=SPECIAL_TOKEN_CHOICES, help=f"when measuring, {SPECIAL_TOKENS_HELP}")
    p.set_defaults(func=_run)
