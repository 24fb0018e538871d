"""`calibclip experiment report`: every figure and generated section of the reproduction.

First round: `<arm>/metrics.jsonl` -> figure `--figure`, the tables and the facts behind the
corrected reading. Second round (when `seed-<n>/<arm>/` folders exist): which runs are used,
per-arm values, paired differences with 95% t-intervals, noise, what each calibration rested
on, the answers to the issue's three questions, a figure `<figure>-seeds.png`, and response
samples of chosen steps. Each
section goes between its markers in `--doc` (a missing pair of markers: printed only). The
output depends only on the committed files, so a second run changes nothing.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from megatron_calibclip.experiment.report import (BEGIN, END, TABLE_SECTION, load_arms, markers,
                                                  plot_arms, report_tables, write_section)
from megatron_calibclip.experiment.report_answers import answers
from megatron_calibclip.experiment.report_calibrations import calibration_table
from megatron_calibclip.experiment.report_facts import facts_table
from megatron_calibclip.experiment.report_limits import limits_section
from megatron_calibclip.experiment.report_paired import (arm_table, coverage, method_text,
                                                         noise_text, paired_table)
from megatron_calibclip.experiment.report_samples import (SamplesError, choose, parse_steps,
                                                          samples_markdown)
from megatron_calibclip.experiment.report_seeds import SeedRuns, load_seeds

FACTS_SECTION, SEEDS_SECTION, SAMPLES_SECTION = ("reproduction-facts", "reproduction-seeds",
                                                 "reproduction-samples")
LIMITS_SECTION = "reproduction-limits"
PROG = "calibclip experiment report"


def seeds_section(seeds: Optional[SeedRuns], figure: Optional[Path], doc_dir: Path) -> str:
    """The second round's generated section (a one-line note before any seed has run)."""
    if seeds is None:
        return ("No `seed-<n>/<arm>/` folder next to the first round's arms yet: the second round "
                "has not run.")
    parts = ["**Runs**", coverage(seeds)]
    if any(seeds.usable(a) for a in seeds.arms()):
        parts += ["**Answers** (generated from the paired intervals below)", answers(seeds),
                  method_text(seeds), "**Per arm**", arm_table(seeds),
                  "**Paired differences**", paired_table(seeds), "**Noise**", noise_text(seeds),
                  "**Calibrations**", calibration_table(seeds)]
    if figure is not None:
        parts.append(f"![paired seeds]({Path(os.path.relpath(figure, doc_dir)).as_posix()})")
    return "\n\n".join(parts)


def samples_section(seeds: Optional[SeedRuns], args: argparse.Namespace) -> str:
    """The samples section; SamplesError when an explicit request cannot be met."""
    asked = args.samples_at is not None or args.samples_seed is not None
    steps = parse_steps(args.samples_at) if args.samples_at is not None else None
    if args.samples_per_arm < 1:
        raise SamplesError(f"--samples-per-arm must be >= 1, got {args.samples_per_arm}")
    if seeds is None:
        if asked:
            raise SamplesError("--samples-at / --samples-seed need seed-<n>/<arm>/ folders; none found")
        return "No response samples yet (they come with the second round's seed folders)."
    try:
        seed, steps, arms = choose(seeds, args.samples_seed, steps)
    except SamplesError:
        if asked:
            raise
        return "No used run of the second round has response samples yet."
    return samples_markdown(seed, steps, arms, args.samples_per_arm)


def _write_doc(doc: Path, sections: dict[str, str]) -> int:
    """Write each section between its markers; only the first round's table is required."""
    if not doc.exists():
        print(f"{PROG}: {doc} does not exist; sections printed only", file=sys.stderr)
        return 2
    for name, text in sections.items():
        if write_section(doc, name, text):
            print(f"section {name}: {doc}")
        elif name == TABLE_SECTION:
            print(f"{PROG}: {doc} has no {BEGIN} ... {END} lines; table printed only", file=sys.stderr)
            return 2
        else:
            print(f"section {name}: no {' ... '.join(markers(name))} lines in {doc}; printed only")
    return 0


def run_report(args: argparse.Namespace) -> int:
    folder = Path(args.metrics_dir or Path(args.experiment).parent)
    arms, seeds = load_arms(folder), load_seeds(folder)
    if not arms and seeds is None:
        print(f"{PROG}: no <arm>/metrics.jsonl and no seed-<n>/<arm>/ under {folder}", file=sys.stderr)
        return 2
    try:
        samples = samples_section(seeds, args)
    except SamplesError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    doc_dir = Path(args.doc).parent if args.doc else Path(".")
    sections: dict[str, str] = {}
    if arms:
        sections[TABLE_SECTION] = report_tables(arms)
        sections[FACTS_SECTION] = facts_table(arms)
        print(f"figure: {plot_arms(arms, Path(args.figure))}")
    seeds_png = None
    if seeds is not None and any(seeds.usable(a) for a in seeds.arms()):
        figure = Path(args.figure)
        seeds_png = figure.with_name(f"{figure.stem}-seeds{figure.suffix}")
        from megatron_calibclip.experiment.report_figure_seeds import plot_seeds

        print(f"figure: {plot_seeds(seeds, seeds_png)}")
    sections[SEEDS_SECTION] = seeds_section(seeds, seeds_png, doc_dir)
    sections[SAMPLES_SECTION] = samples
    sections[LIMITS_SECTION] = limits_section(seeds)
    for text in sections.values():
        print(text + "\n")
    return _write_doc(Path(args.doc), sections) if args.doc else 0
