"""`calibclip experiment ...`: survey tasks, run an experiment's arms, report them."""
from __future__ import annotations

import argparse
import json
import sys

DEFAULT_EXPERIMENT = "experiments/reproduction/experiment.yaml"


def _cmd_survey(args: argparse.Namespace) -> int:
    from megatron_calibclip.config import ConfigError
    from megatron_calibclip.experiment.survey import CANDIDATES, run_survey

    names = args.tasks or list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        print(f"calibclip experiment survey: unknown task(s) {unknown}; known: "
              f"{', '.join(CANDIDATES)}", file=sys.stderr)
        return 2
    try:
        result = run_survey(args.config, list(args.set or []), names, args.problems,
                            args.group_size)
    except ConfigError as err:
        print(f"calibclip experiment survey: invalid configuration: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


def add_experiment_parser(sub) -> None:
    from megatron_calibclip.experiment.report_run import run_report
    from megatron_calibclip.experiment.reproduce import run_reproduce

    p = sub.add_parser("experiment", help="the reproduction experiment: survey, run, report")
    esub = p.add_subparsers(dest="experiment_command", required=True)

    s = esub.add_parser("survey", help="step-0 accuracy of the model on candidate tasks (JSON)")
    s.add_argument("--config", default="smollm2-135m-cpu", help="training config (the model)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override")
    s.add_argument("--tasks", nargs="+", help="candidate names (default: all)")
    s.add_argument("--problems", type=int, default=64, help="held-out problems per task")
    s.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    s.set_defaults(func=_cmd_survey)

    r = esub.add_parser("reproduce", help="run (or resume) the arms of one round of an experiment file")
    r.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="experiment YAML")
    r.add_argument("--seed", type=int, help="run.seed of a seeded round: its arms run in "
                                            "RUNS_DIR/seed-N/<arm>/ and are copied to seed-N/<arm>/")
    r.add_argument("--round", help="round of the file (default: the last seeded round with --seed, "
                                   "else the first round without seeds)")
    r.add_argument("--arms", nargs="+", help="only these arms, as a,b or a b (default: the round's, in order)")
    r.add_argument("--nproc", type=int, default=2, help="ranks per arm (torchrun)")
    r.add_argument("--runs-dir", default="runs/reproduction", help="where the runs live")
    r.add_argument("--metrics-dir", help="where <arm>/ (seeded: seed-N/<arm>/) files are copied "
                                         "(default: the experiment file's folder)")
    r.add_argument("--keep-going", action="store_true", help="run the next arm after a failure")
    r.set_defaults(func=run_reproduce)

    g = esub.add_parser("report", help="figures and tables from the committed metrics")
    g.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help="experiment YAML")
    g.add_argument("--metrics-dir", help="folder of <arm>/metrics.jsonl and seed-<n>/<arm>/ "
                                         "(default: the experiment file's folder)")
    g.add_argument("--figure", default="docs/figures/reproduction.png",
                   help="PNG to write (paired seeds: <name>-seeds.png beside it)")
    g.add_argument("--doc", default="docs/reproduction.md",
                   help="markdown whose section markers receive the tables ('' to skip)")
    g.add_argument("--samples-at", metavar="STEPS",
                   help="response samples of these steps, e.g. 0,50,99 (default: first, middle, last)")
    g.add_argument("--samples-per-arm", type=int, default=2, help="samples shown per step and arm")
    g.add_argument("--samples-seed", type=int, help="seed whose samples are shown (default: lowest)")
    g.set_defaults(func=run_report)
