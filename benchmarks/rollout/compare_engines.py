"""The reproduction's BF16 arm with the rollout on vLLM next to the same arm on our megatron
engine: learning (reward, held-out accuracy) and the rollout/trainer mismatch, over the same
steps. Reads only committed metrics:
  experiments/reproduction/bf16/metrics.jsonl   (rollout.engine: megatron)
  experiments/vllm/bf16-vllm/metrics.jsonl      (rollout.engine: vllm)

The mismatch is the trainer's `loss/mult_prob_error` = mean over response tokens of
exp(|log pi_rollout - log pi_old|) (1 = identical log-probs), with the TIS weight statistics.
Seconds per phase come from two runs at different times on a shared machine: informational
only (benchmarks/rollout/bench_engines.py measures speed side by side in one run).

Run:  .venv/bin/python benchmarks/rollout/compare_engines.py [--steps N]
Prints one JSON document.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ARMS = {"megatron": Path("experiments/reproduction/bf16/metrics.jsonl"),
        "vllm": Path("experiments/vllm/bf16-vllm/metrics.jsonl")}
WINDOW = 10


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(statistics.fmean(values), 4) if values else None


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(statistics.median(values), 3) if values else None


def summary(rows: list[dict]) -> dict:
    first, last = rows[:WINDOW], rows[-WINDOW:]
    return {
        "steps": len(rows),
        f"reward_first_{WINDOW}": _mean(first, "reward_mean"),
        f"reward_last_{WINDOW}": _mean(last, "reward_mean"),
        "heldout_accuracy": {int(r["eval/updates"]): r["eval/accuracy"] for r in rows
                             if "eval/accuracy" in r},
        "mult_prob_error_mean": _mean(rows, "loss/mult_prob_error"),
        f"mult_prob_error_first_{WINDOW}": _mean(first, "loss/mult_prob_error"),
        f"mult_prob_error_last_{WINDOW}": _mean(last, "loss/mult_prob_error"),
        "tis_clipfrac_mean": _mean(rows, "loss/tis_clipfrac"),
        "is_weight_mean": _mean(rows, "loss/is_weight_mean"),
        "entropy_mean": _mean(rows, "loss/entropy_mean"),
        "seconds_median": {k.removeprefix("time/"): _median(rows, k) for k in
                           ("time/rollout", "time/weight_sync", "time/logprobs",
                            "time/update", "time/step")},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="compare the first N steps "
                   "(default: as many as both arms have)")
    args = p.parse_args()
    rows = {arm: _records(path) for arm, path in ARMS.items()}
    n = args.steps or min(len(r) for r in rows.values())
    out = {"steps_compared": n, "arms": {arm: summary(r[:n]) for arm, r in rows.items()}}
    m, v = out["arms"]["megatron"], out["arms"]["vllm"]
    out["mult_prob_error_excess"] = {  # how far each engine's log-probs sit from the trainer's
        arm: round(s["mult_prob_error_mean"] - 1.0, 4) for arm, s in out["arms"].items()}
    out["ratio_rollout_seconds_megatron_over_vllm"] = round(
        m["seconds_median"]["rollout"] / v["seconds_median"]["rollout"], 2)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
