"""The second round's figure, checked on its matplotlib objects (lines, collections, texts,
axis limits; not pixels) for synthetic seed folders: each seed drawn when there are few, the
paired-difference rows legible and an interval that excludes 0 marked, the clip bounds' right
edge said to be the last step's geometric mean."""
import json

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import same_color  # noqa: E402

from megatron_calibclip.experiment.report_answers import METRICS  # noqa: E402
from megatron_calibclip.experiment.report_figure_seeds import ARM_COLORS, seeds_figure  # noqa: E402
from megatron_calibclip.experiment.report_paired import pair_intervals, pair_label  # noqa: E402
from megatron_calibclip.experiment.report_seeds import load_seeds  # noqa: E402

from .seed_runs import STEPS, write_seeds  # noqa: E402

BF16_EOS = {1: 0.0, 2: 0.99, 3: 0.99}  # as the first seeds: one BF16 run never ends its answers


def _figure(folder, seeds):
    write_seeds(folder, seeds=seeds)
    for seed in seeds:  # BF16's EOS fraction apart across seeds, as seen on seeds 1000 and 2000
        path = folder / f"seed-{seed}" / "bf16" / "metrics.jsonl"
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        for r in recs:
            r["eos_fraction"] = BF16_EOS.get(seed, 0.5)
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    loaded = load_seeds(folder)
    return loaded, seeds_figure(loaded)


@pytest.fixture(scope="module")
def three_seeds(tmp_path_factory):
    seeds, fig = _figure(tmp_path_factory.mktemp("three") / "exp", (1, 2, 3))
    yield seeds, fig
    plt.close(fig)


def _panel(fig, title):
    """The axes whose title starts with `title`."""
    (ax,) = [ax for ax in fig.axes if ax.get_title().startswith(title)]
    return ax


def _arm_lines(ax, arm):
    return [line for line in ax.get_lines() if same_color(line.get_color(), ARM_COLORS[arm])]


def test_few_seeds_draw_each_seed_not_a_band(three_seeds):
    """With 3 seeds, BF16's EOS fraction 0.0 in one and 0.99 in two drew a mean of 0.66 that no
    run had inside a band over the whole panel. Each seed is now a thin line of the arm's
    colour under the bold mean, no band is drawn, and the title says so."""
    _, fig = three_seeds
    ax = _panel(fig, "EOS fraction")
    assert not ax.collections  # no min-max band
    for arm in ARM_COLORS:
        lines = _arm_lines(ax, arm)
        bold = [line for line in lines if line.get_alpha() is None]
        thin = [line for line in lines if line.get_alpha() is not None]
        assert len(bold) == 1 and len(thin) == 3
        assert all(t.get_alpha() < 1 and t.get_linewidth() < bold[0].get_linewidth() for t in thin)
    thin_ends = sorted(float(line.get_ydata()[-1]) for line in _arm_lines(ax, "bf16")
                       if line.get_alpha() is not None)
    assert thin_ends == [pytest.approx(0.0), pytest.approx(0.99), pytest.approx(0.99)]
    suptitle = fig.get_suptitle()
    assert "thin: each seed" in suptitle and "band" not in suptitle


def test_more_seeds_keep_the_band(tmp_path):
    """With 4 seeds per arm the min-max band stays (one per arm), no seed is drawn alone."""
    _, fig = _figure(tmp_path / "exp", (1, 2, 3, 4))
    ax = _panel(fig, "EOS fraction")
    assert len(ax.collections) == len(ARM_COLORS)
    for arm in ARM_COLORS:
        assert len(_arm_lines(ax, arm)) == 1
    assert "band / bars = min-max across seeds" in fig.get_suptitle() and "thin" not in fig.get_suptitle()
    plt.close(fig)


def _row_lines(ax, y):
    """The lines drawn at height y only (a row's marks, not the vertical line at 0)."""
    return [line for line in ax.get_lines() if set(line.get_ydata()) == {y}]


def test_forest_rows_show_dots_intervals_and_mark_exclusions(three_seeds):
    """An interval that excluded 0 hid under its diamond and read as a point, and the seeds'
    dots hid too. Per row now: the diamond, the interval over it with caps (black and thick
    when it excludes 0, the row label ending in '*'), the dots on top with a white edge."""
    seeds, fig = three_seeds
    ax = _panel(fig, "paired differences")
    rows = [(arm, diffs, iv, pair_label(arm, base)) for q in METRICS
            for (arm, base), (diffs, iv) in pair_intervals(seeds, q).items()]
    excluded = [iv.excludes_zero() for _, _, iv, _ in rows]
    assert any(excluded) and not all(excluded)  # the fixture has both kinds
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        label + (" *" if ex else "") for (_, _, _, label), ex in zip(rows, excluded)]
    assert "* interval excludes 0" in ax.get_title()
    for y, (arm, diffs, iv, _), ex in zip(ax.get_yticks(), rows, excluded):
        lines = _row_lines(ax, y)
        (diamond,) = [line for line in lines if line.get_marker() == "D"]
        (bar,) = [line for line in lines if line.get_marker() == "|"]
        (dots,) = [line for line in lines if line.get_marker() == "o"]
        assert list(bar.get_xdata()) == [pytest.approx(iv.low), pytest.approx(iv.high)]
        assert bar.get_markersize() >= 8  # caps: a zero-width interval still shows
        assert same_color(bar.get_color(), "k" if ex else ARM_COLORS[arm])
        assert (bar.get_linewidth() >= 3) == ex
        assert list(dots.get_xdata()) == pytest.approx(list(diffs.values()))
        assert diamond.get_zorder() < bar.get_zorder() < dots.get_zorder()
        assert dots.get_markeredgewidth() > 0
        assert not same_color(dots.get_markeredgecolor(), dots.get_markerfacecolor())


def test_forest_row_labels_are_legible_and_apart(three_seeds):
    """The row labels were 7 pt. At >= 8.5 pt no two labels' rendered boxes overlap, nor does
    any reach into the held-out panel on its left."""
    _, fig = three_seeds
    ax = _panel(fig, "paired differences")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = ax.get_yticklabels()
    assert all(t.get_fontsize() >= 8.5 for t in labels)
    boxes = [t.get_window_extent(renderer) for t in labels]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
    left = _panel(fig, "held-out greedy accuracy").get_window_extent(renderer)
    assert min(b.x0 for b in boxes) > left.x1


def test_bounds_panel_says_what_the_right_edge_is(three_seeds):
    """The right-edge labels are geometric means over seeds at the last step (the tables give
    arithmetic means over steps 20-99): the title says so. The x axis keeps its room for the
    labels, but ticks stop at the last step."""
    _, fig = three_seeds
    ax = _panel(fig, "clip bounds in force")
    assert "geometric mean over seeds" in ax.get_title() and "at the last step" in ax.get_title()
    low, high = ax.get_xlim()
    assert high > 1.5 * STEPS  # room for the labels kept
    shown = [t for t in ax.get_xticks() if low <= t <= high]
    assert shown and min(shown) == 0 and max(shown) <= STEPS - 1
