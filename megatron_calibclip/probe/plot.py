"""One PNG for the fp8-noise probe result (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_fp8_noise(result: dict[str, Any], path: str | Path) -> Path:
    """Three panels: static |dlogp| by probability bucket, log-ratio noise std per source,
    phantom-clip rate per source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    recipes = list(result["config"]["recipes"])
    labels = result["prob_buckets"]["labels"]
    sources = list(result["sources"])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))

    ax = axes[0]
    x = np.arange(len(labels))

    def series(values):
        return [np.nan if v is None else max(v, 1e-9) for v in values]

    ax.plot(x, series(result["static"]["bf16"]["vs_fp32"]["mean"]), "k--o", label="bf16 vs fp32")
    for i, r in enumerate(recipes):
        ax.plot(x, series(result["static"][r]["vs_bf16"]["mean"]), "-o",
                color=colors[i % len(colors)], label=f"{r} vs bf16")
    ax.set_xticks(x, [f"{lab}\nn={n}" for lab, n in zip(labels, result["prob_buckets"]["count"])],
                  fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("token probability (fp32)")
    ax.set_ylabel("mean |delta log p|")
    ax.set_title("static log-prob error")
    ax.legend(fontsize=8)

    keys = ["bf16"] + recipes
    width = 0.8 / len(keys)
    xs = np.arange(len(sources))
    for panel, (metric, title, ylabel) in enumerate([
            ("noise_std_vs_fp32", "log-ratio noise vs fp32", "std(log r - log r_fp32)"),
            ("phantom_vs_bf16", f"phantom clips (eps_low={result['config']['eps_low']:g})",
             "P(r < 1-eps, r_bf16 >= 1-eps | A<0)")]):
        ax = axes[panel + 1]
        for i, k in enumerate(keys):
            m = "phantom_vs_fp32" if (k == "bf16" and metric == "phantom_vs_bf16") else metric
            vals = [result["sources"][s][k][m] for s in sources]
            ax.bar(xs + (i - (len(keys) - 1) / 2) * width, vals, width,
                   color="k" if k == "bf16" else colors[(i - 1) % len(colors)],
                   hatch="//" if k == "bf16" else None, alpha=0.5 if k == "bf16" else 1.0,
                   label="bf16 (vs fp32)" if k == "bf16" and m != metric else k)
        ax.set_xticks(xs, sources, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    model = result["model"]
    fig.suptitle(f"FP8 noise probe: {model['preset']} ({model['weights']}), "
                 f"{result['data']['num_tokens']} tokens, "
                 f"warm-up {result['warmup']['steps']} steps",
                 fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
