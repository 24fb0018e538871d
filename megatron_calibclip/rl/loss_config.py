"""The policy loss's options as one typed record, grouped by the term that reads them.

Why: policy_loss used to take 27 keywords, and nothing said which knob belonged to which
part of the loss. LossConfig declares every option once, next to the term that owns it,
and checks it once, with an error that names the field and what is allowed. The trainer's
YAML section (`config.PolicyLossConfig`) maps onto it in one place (`loss_config()`).
The clip bounds [L, H] are not options: Calibrated Clipping moves them between steps, so
they are arguments of the loss call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_calibclip.config import need as _need
from megatron_calibclip.rl.aggregation import AGG_MODES, LossAggMode
from megatron_calibclip.rl.corrections import CORRECTIONS, SEQ_WEIGHTS, SeqWeight
from megatron_calibclip.rl.kl import KL_TYPES, KLType


@dataclass(frozen=True)
class LossConfig:
    # ---- clipped surrogate (surrogate.py) ----
    # Dual-clip for A<0 tokens: loss capped at -c*A (Ye et al. 2020); c must be > 1.
    dual_clip: bool = False
    dual_clip_c: float = 3.0
    # |log r| is clamped to this before exp (overflow guard; zero gradient beyond).
    log_ratio_clamp: float = 20.0
    # ---- rollout/trainer correction (corrections.py) ----
    # A name registered in corrections.CORRECTIONS: none, tis, mis-token, mis-seq,
    # mis-token-two-sided. w = pi_old / pi_rollout per token; needs rollout_logprobs.
    correction: str = "none"
    # The cap C of TIS / the upper threshold of MIS.
    correction_cap: float = 2.0
    # The lower threshold of mis-token-two-sided (tokens with w < it are masked); < correction_cap.
    correction_cap_low: float = 0.5
    # Sequence weight of mis-seq: product (exact sequence ratio) or geometric (per-token mean).
    mis_seq_weight: SeqWeight = "product"
    # ---- penalties (penalties.py) ----
    # KL penalty coefficient beta (0: KL only logged, if reference log-probs are given).
    kl_coef: float = 0.0
    # KL estimator: k1 (log-ratio), k2 (squared / 2), k3 (low-variance, clamped).
    kl_type: KLType = "k3"
    # Entropy bonus coefficient (0: entropy only logged, if given).
    entropy_coef: float = 0.0
    # ---- aggregation (aggregation.py) ----
    # token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO).
    loss_agg_mode: LossAggMode = "token-mean"
    # Constant divisor of seq-mean-token-sum-norm (the generation budget); None = padded length.
    max_response_length: int | None = None
    # ---- diagnostics (loss_diagnostics.py) ----
    # Host eps_low: a shadow token with r_bf16 < 1 - eps_low is clipped by BF16 (phantom-clip
    # metrics); required when a shadow log-ratio is given.
    shadow_eps_low: float | None = None
    # Host eps_high for the shadow's upper clip fraction; None: not reported.
    shadow_eps_high: float | None = None

    def __post_init__(self) -> None:
        _need(self.loss_agg_mode in AGG_MODES, "loss_agg_mode", self.loss_agg_mode, f"one of {list(AGG_MODES)}")
        _need(self.kl_type in KL_TYPES, "kl_type", self.kl_type, f"one of {list(KL_TYPES)}")
        _need(self.correction in CORRECTIONS, "correction", self.correction, f"one of {sorted(CORRECTIONS)}")
        _need(self.mis_seq_weight in SEQ_WEIGHTS, "mis_seq_weight", self.mis_seq_weight, f"one of {list(SEQ_WEIGHTS)}")
        if self.dual_clip:
            _need(math.isfinite(self.dual_clip_c) and self.dual_clip_c > 1.0, "dual_clip_c", self.dual_clip_c,
                  "a finite number > 1 (e.g. 3)")
        _need(self.log_ratio_clamp > 0.0, "log_ratio_clamp", self.log_ratio_clamp, "> 0 (e.g. 20)")
        _need(math.isfinite(self.correction_cap) and self.correction_cap > 0.0, "correction_cap",
              self.correction_cap, "a positive finite number (e.g. 2)")
        check = CORRECTIONS[self.correction].check
        if check is not None:
            check(self)
        if self.max_response_length is not None:
            _need(self.max_response_length > 0, "max_response_length", self.max_response_length, "a positive int")
        if self.shadow_eps_low is not None:
            _need(0.0 < self.shadow_eps_low < 1.0, "shadow_eps_low", self.shadow_eps_low,
                  "an epsilon in (0, 1) such as 0.2 (not a ratio bound)")
        if self.shadow_eps_high is not None:
            _need(self.shadow_eps_high > 0.0, "shadow_eps_high", self.shadow_eps_high, "an epsilon > 0 such as 0.28")
