"""The committed reproduction document is what `calibclip experiment report` generates from
the committed runs: a run copied in without regenerating, or a generated section edited by
hand, fails here. Text sections only (the figures' pixels depend on matplotlib's version)."""
from __future__ import annotations

import argparse
from pathlib import Path

from megatron_calibclip.experiment.report import TABLE_SECTION, load_arms, markers, report_tables
from megatron_calibclip.experiment.report_facts import facts_table
from megatron_calibclip.experiment.report_limits import limits_section
from megatron_calibclip.experiment.report_run import (FACTS_SECTION, LIMITS_SECTION, SAMPLES_SECTION,
                                                      SEEDS_SECTION, samples_section, seeds_section)
from megatron_calibclip.experiment.report_seeds import load_seeds

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "reproduction.md"
RUNS = REPO / "experiments" / "reproduction"


def _committed(name: str) -> str:
    begin, end = markers(name)
    text = DOC.read_text()
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def test_every_generated_section_of_the_document_matches_the_committed_runs():
    arms, seeds = load_arms(RUNS), load_seeds(RUNS)
    assert arms and seeds is not None  # both rounds are committed
    defaults = argparse.Namespace(samples_at=None, samples_seed=None, samples_per_arm=2)
    figure = DOC.parent / "figures" / "reproduction-seeds.png"
    expected = {TABLE_SECTION: report_tables(arms), FACTS_SECTION: facts_table(arms),
                SEEDS_SECTION: seeds_section(seeds, figure, DOC.parent),
                SAMPLES_SECTION: samples_section(seeds, defaults),
                LIMITS_SECTION: limits_section(seeds)}
    for name, text in expected.items():
        assert _committed(name) == text, f"docs/reproduction.md section {name!r} is stale: " \
                                         "run `calibclip experiment report`"


def _reading() -> str:
    """The hand-written reading of the second round: from its heading to the next one."""
    text = DOC.read_text()
    return text.split("### Reading of the second round", 1)[1].split("\n#", 1)[0]


def test_every_number_of_the_second_reading_is_a_generated_one():
    """The reading refers to the generated sections, not to numbers typed by hand: each decimal
    it quotes (0.054, +0.011, 12.71) stands in a generated section of the document."""
    import re

    generated = "\n".join(_committed(name) for name in (SEEDS_SECTION, SAMPLES_SECTION,
                                                        LIMITS_SECTION))
    number = r"(?<![\d.])[+-]?\d+\.\d{2,}(?![\d])"  # whole numbers: 0.05 is not in 0.054
    quoted = {n.lstrip("+") for n in re.findall(number, _reading())}
    stands = {n.lstrip("+") for n in re.findall(number, generated)}
    assert quoted, "the reading quotes no generated number"
    assert sorted(quoted - stands) == []
