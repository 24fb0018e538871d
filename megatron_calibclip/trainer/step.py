"""One RL step, as data (README, "Layout"):

prompts -> rollout (rollout precision, keeps rollout log-probs) -> rewards -> advantages
-> [DAPO: dynamic sampling] -> reference and old log-probs (old: trainer precision, its own
micro-batch size) -> on a calibration step (and every diagnostics.shadow_every steps): BF16
shadow of pi_old -> per mini-batch: [shadow step: BF16 shadow of pi_theta, no grad] -> loss
with [L, H], TIS, KL -> optimizer step -> [calibration: histograms of FP8 vs shadow
log-ratios] -> metrics.

Every rank of a model replica (TP x PP) holds the same batch; data-parallel replicas hold
different prompts, and every count, normaliser and histogram is pooled over the DP group.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_calibclip.models import place_on_device
from megatron_calibclip.parallel.devices import HOST, collective_device
from megatron_calibclip.rl import (
    LossInputs,
    dynamic_sampling_filter,
    finalize_metrics,
    grpo_advantages,
    overlong_penalty,
    policy_loss,
)
from megatron_calibclip.rl.diagnostics import FRACTIONS, merge_counts, merge_extrema
from megatron_calibclip.rollout import RolloutBatch
from megatron_calibclip.fp8.weight_cache import invalidate_weight_caches
from megatron_calibclip.trainer.components import Components
from megatron_calibclip.trainer.forward import (
    broadcast_from_last_stage,
    compute_logprobs,
    run_schedule,
    split_micro_batches,
    token_logprobs,
)

@dataclass
class StepData:
    batch: RolloutBatch
    rewards: torch.Tensor  # [B]
    advantages: torch.Tensor  # [B] (sequence-level, broadcast over tokens)
    mask: torch.Tensor  # [B, S-1] response tokens
    n_groups: int


class Timer:
    """Wall seconds per phase, and this process's CPU seconds (all its threads), which other
    processes on a shared machine do not inflate: what benchmarks compare."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.cpu_times: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t, self.c = time.perf_counter(), time.process_time()

            def __exit__(self, *exc):
                timer.times[name] = timer.times.get(name, 0.0) + time.perf_counter() - self.t
                timer.cpu_times[name] = (timer.cpu_times.get(name, 0.0)
                                         + time.process_time() - self.c)

        return _Ctx()


@contextlib.contextmanager
def reference_on_device(c: Components):
    """With model.offload_reference on a GPU run, the reference lives in host memory and visits
    the GPU only for its forward (its weight caches are dropped on the way out, or they would
    keep a BF16 copy of it on the GPU); otherwise a no-op."""
    offload = c.cfg.model.offload_reference and c.device.type != "cpu"
    if offload:
        place_on_device(c.reference, c.device)
    try:
        yield
    finally:
        if offload:  # everything it owns: parameters, RoPE's inv_freq, its BF16 weight caches
            place_on_device(c.reference, HOST)
            invalidate_weight_caches(c.reference)


def _seed(c: Components, step: int, round_: int) -> int:
    return (c.cfg.run.seed * 1_000_003 + step * 7919 + round_ * 104_729 + c.dp_rank) % 2**62


def _score(c: Components, prompts, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    g = c.cfg.algorithm.group_size
    rewards = []
    for i, resp in enumerate(batch.responses()):
        text = c.tokenizer.decode(resp)
        rewards.append(c.reward_fn(text, prompts[i // g].record))
    r = torch.tensor(rewards, dtype=torch.float32, device=c.device)
    correct = r >= c.cfg.reward.correct_threshold
    return r, correct


def _concat(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Stack rollout batches with different prompt/response widths into one layout."""
    if len(batches) == 1:
        return batches[0]
    p = max(b.prompt_width for b in batches)
    r = max(b.tokens.shape[1] - b.prompt_width for b in batches)
    toks, lps = [], []
    for b in batches:
        shift = p - b.prompt_width
        t = torch.full((b.batch_size, p + r), pad_id, dtype=torch.long, device=b.tokens.device)
        t[:, shift: shift + b.tokens.shape[1]] = b.tokens
        lp = torch.zeros(b.batch_size, p + r - 1, device=b.rollout_logprobs.device)
        lp[:, shift: shift + b.rollout_logprobs.shape[1]] = b.rollout_logprobs
        toks.append(t)
        lps.append(lp)
    return RolloutBatch(torch.cat(toks), p, torch.cat([b.prompt_lengths for b in batches]),
                        torch.cat([b.response_lengths for b in batches]),
                        torch.cat([b.finished for b in batches]), torch.cat(lps), pad_id)


def collect(c: Components, step: int, timer: Timer, stats: dict) -> Optional[StepData]:
    """Rollout, rewards, advantages; DAPO dynamic sampling with refill. None: no data."""
    a = c.cfg.algorithm
    g = a.group_size
    local_n = a.prompts_per_step // c.dp_size
    kept_batches, kept_rewards, kept_groups = [], [], 0
    rounds = a.dynamic_sampling_max_rounds if a.dynamic_sampling else 1
    all_rewards = []
    for round_ in range(rounds):
        prompts = c.dataset.next_batch(a.prompts_per_step)[c.dp_rank::c.dp_size]
        ids = [list(p.ids) for p in prompts for _ in range(g)]
        with timer("rollout"):
            batch = c.engine.generate(ids, c.cfg.rollout.sampling, seed=_seed(c, step, round_))
        with timer("reward"):
            rewards, correct = _score(c, prompts, batch)
        all_rewards.append(rewards)
        if a.dynamic_sampling:
            keep = dynamic_sampling_filter(correct, group_size=g)
            idx = torch.nonzero(keep.repeat_interleave(g)).squeeze(-1)
            stats["dynamic_sampling/groups_seen"] = stats.get("dynamic_sampling/groups_seen",
                                                              0) + len(prompts)
            if idx.numel():
                kept_batches.append(batch.select(idx))
                kept_rewards.append(rewards[idx])
                kept_groups += idx.numel() // g
        else:
            kept_batches.append(batch)
            kept_rewards.append(rewards)
            kept_groups += len(prompts)
        # every rank must draw the same number of prompt batches (the data cursor is shared)
        need = torch.tensor([1.0 if kept_groups < local_n else 0.0], device=collective_device())
        dist.all_reduce(need, op=dist.ReduceOp.MAX)
        if need.item() == 0:
            break
    seen = torch.cat(all_rewards)
    pooled = _dp_all_reduce(torch.tensor([float(seen.sum()), float(seen.numel()),
                                          float(stats.get("dynamic_sampling/groups_seen", 0))],
                                         dtype=torch.float64,
                                         device=collective_device(c.dp_group)), c.dp_group)
    stats["reward_all_mean"] = float(pooled[0] / pooled[1])  # before dynamic sampling
    if a.dynamic_sampling:
        stats["dynamic_sampling/groups_seen"] = float(pooled[2])
    # equal work on every DP rank: trim to the smallest kept count
    n = torch.tensor([float(min(kept_groups, local_n))], device=collective_device())
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    n_groups = int(n.item())
    if a.dynamic_sampling:
        stats["dynamic_sampling/groups_kept"] = n_groups * c.dp_size
    if n_groups == 0:
        return None
    batch = _concat(kept_batches, c.tokenizer.pad_id)
    rewards = torch.cat(kept_rewards)
    sel = torch.arange(n_groups * g, device=batch.tokens.device)
    batch, rewards = batch.select(sel), rewards[sel]
    shaped = rewards.clone()
    if a.overlong_max_length > 0:
        shaped = shaped + overlong_penalty(batch.response_lengths,
                                           max_length=a.overlong_max_length,
                                           cache_length=a.overlong_cache_length).float()
    adv = grpo_advantages(shaped, group_size=g, normalize_std=a.advantage_std)
    return StepData(batch, rewards, adv.float(), batch.response_mask, n_groups)


def _dp_all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, op=op, group=group)
    return t


def train_step(c: Components, step: int,
               on_data: Optional[Callable[[StepData], None]] = None) -> dict[str, Any]:
    """Run one RL step; returns the step's metrics (identical on every rank). `on_data` sees
    this rank's rollouts, rewards and advantages before the update (e.g. to write samples)."""
    timer = Timer()
    stats: dict[str, Any] = {"step": step}
    lower, upper = (c.clipper.begin_step(step) if c.clipper is not None
                    else c.cfg.clipping.fixed_bounds(c.cfg.loss.default_bounds))
    calibrating = c.clipper is not None and c.clipper.is_calibration_step(step)
    data = collect(c, step, timer, stats)
    if data is None:
        stats["skipped"] = "no group with mixed rewards after dynamic sampling"
        stats.update({"clip/lower": lower, "clip/upper": upper})
        return stats
    if on_data is not None:
        on_data(data)
    stats.update(update_policy(c, data, step, lower, upper, calibrating, timer))
    for k, v in timer.times.items():
        stats[f"time/{k}"] = v
        stats[f"time/cpu/{k}"] = timer.cpu_times[k]
    return stats


def update_policy(c: Components, data: StepData, step: int, lower: float, upper: float,
                  calibrating: bool, timer: Timer) -> dict[str, Any]:
    """Log-probs, shadow passes, mini-batch updates and calibration for one step's data."""
    cfg = c.cfg
    stats: dict[str, Any] = {}
    b = data.batch
    vocab, temp = c.model_cfg.vocab_size, cfg.rollout.sampling.temperature
    attn = b.attention_mask()
    lp_kw = dict(vocab_size=vocab, temperature=temp, pad_id=b.pad_id,
                 micro_batch_size=cfg.algorithm.logprob_micro_batch_size)
    with timer("logprobs"):
        with c.trainer_precision():
            old_lp, _ = compute_logprobs(c.ddp, b.tokens, attn, **lp_kw)
        with reference_on_device(c):
            ref_lp, _ = compute_logprobs(c.reference, b.tokens, attn, **lp_kw)
    shadow_old = None
    every = cfg.diagnostics.shadow_every
    shadowing = calibrating or bool(every and step % every == 0)  # diagnostics: same passes
    if shadowing:
        with timer("shadow"):
            with c.shadow_precision():
                shadow_old, _ = compute_logprobs(c.ddp, b.tokens, attn, **lp_kw)
    if calibrating:
        acc = c.clipper.new_accumulator(c.device)

    # ---- mini-batch updates ------------------------------------------------------------
    n = b.batch_size
    chunks = np.array_split(np.arange(n), cfg.algorithm.mini_batches)
    mb_counts: list[dict] = []  # per micro-batch, summed once at the end
    mb_extrema: list[dict] = []
    grad_norms = []
    loss_values: list[float] = []
    loss_cfg = cfg.loss.loss_config(generation_budget=cfg.rollout.sampling.max_new_tokens)
    for chunk in chunks:
        if len(chunk) == 0:
            continue
        idx = torch.as_tensor(chunk, device=data.mask.device)
        mask = data.mask[idx]
        glob = _dp_all_reduce(torch.tensor([float(mask.sum()), float(mask.any(1).sum())],
                                           dtype=torch.float64,
                                           device=collective_device(c.dp_group)), c.dp_group)
        tensors = {"tokens": b.tokens[idx], "attention_mask": attn[idx], "mask": mask,
                   "old_lp": old_lp[idx], "ref_lp": ref_lp[idx],
                   "rollout_lp": b.rollout_logprobs[idx],
                   "adv": data.advantages[idx].unsqueeze(1).expand_as(mask).contiguous()}
        if shadowing:
            with timer("shadow"):
                with c.shadow_precision():
                    shadow_theta, _ = compute_logprobs(c.ddp, b.tokens[idx], attn[idx], **lp_kw)
            tensors["shadow_lr"] = shadow_theta - shadow_old[idx]
        mbs, rows = split_micro_batches(tensors, cfg.algorithm.micro_batch_size,
                                        {"tokens": b.pad_id, "attention_mask": True,
                                         "mask": False})
        norm_kw = ({"num_tokens": glob[0]} if cfg.loss.loss_agg_mode == "token-mean"
                   else {"num_sequences": glob[1]})

        def loss_fn(mb, logits):
            lp, ent = token_logprobs(logits, mb["tokens"], vocab, temp)
            m = mb["mask"]
            if not bool(m.any()):  # a padding micro-batch: no loss, no gradient
                return lp.sum() * 0.0, {"lp": lp.detach(), "counts": None, "loss": None}
            inputs = LossInputs(lp, mb["old_lp"], mb["adv"], m, rollout_logprobs=mb["rollout_lp"],
                                ref_logprobs=mb["ref_lp"], entropy=ent,
                                shadow_log_ratio=mb.get("shadow_lr"), **norm_kw)
            loss, metrics = policy_loss(inputs, config=loss_cfg, clip_low=lower, clip_high=upper,
                                        validate=False)
            return loss, {"lp": lp.detach(), "counts": metrics["counts"], "loss": loss.detach(),
                          "extrema": metrics.get("extrema", {})}

        with timer("update"):
            c.ddp.zero_grad_buffer()
            c.optimizer.zero_grad()
            with c.trainer_precision():
                outs = run_schedule(c.ddp, mbs, loss_fn, forward_only=False,
                                    seq_length=b.tokens.shape[1])
            ok, grad_norm, _ = c.optimizer.step()
            invalidate_weight_caches(c.policy)  # the distributed optimizer writes via .data
        grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
        # per-token FP8 log-probs of this update's forward, on every stage of the replica
        shape = (len(mbs) * mbs[0]["tokens"].shape[0], b.tokens.shape[1] - 1)
        cur = torch.cat([o["lp"] for o in outs]) if ps.is_pipeline_last_stage() else None
        cur = broadcast_from_last_stage(cur, shape, torch.float32, c.device)[:rows]
        if ps.is_pipeline_last_stage():
            loss_values.extend(float(o["loss"]) for o in outs if o["loss"] is not None)
            mb_counts.extend(o["counts"] for o in outs if o["counts"] is not None)
            mb_extrema.extend(o["extrema"] for o in outs if o["counts"] is not None)
        if calibrating:
            acc.add(cur - old_lp[idx], tensors["shadow_lr"], tensors["adv"], mask)

    with timer("weight_sync"):  # an engine with its own weights (vLLM) reloads them
        c.engine.sync_weights()

    # ---- calibration: bounds for the next step --------------------------------------------
    if calibrating:
        with timer("calibration"):
            result = c.clipper.compute(acc, step, group=c.dp_group)
            c.clipper.save_inputs(acc, step, result, group=c.dp_group)
        stats.update(c.clipper.metrics())
        stats["calib/ran"] = 1.0
    counts_total = merge_counts(mb_counts) if mb_counts else {}
    stats.update(_reduce_loss_metrics(c, counts_total, merge_extrema(mb_extrema)))
    stats.update(_batch_metrics(c, data))
    stats["grad_norm"] = float(np.nanmean(grad_norms)) if grad_norms else float("nan")
    stats["clip/lower"], stats["clip/upper"] = lower, upper
    if c.clipper is not None:
        stats["clip/next_lower"], stats["clip/next_upper"] = c.clipper.next_bounds
    dev = collective_device(c.dp_group)
    total_loss = torch.tensor([sum(loss_values)], dtype=torch.float64, device=dev)
    total_loss = broadcast_from_last_stage(total_loss if ps.is_pipeline_last_stage() else None, (1,),
                                           torch.float64, dev)
    stats["loss/total"] = float(_dp_all_reduce(total_loss, c.dp_group)) / max(len(grad_norms), 1)
    return stats


def _reduce_loss_metrics(c: Components, counts: dict, extrema: dict) -> dict[str, float]:
    """Sum counts over micro-batches (done) and DP ranks; share them across PP stages."""
    keys = sorted({k for pair in FRACTIONS.values() for k in pair})
    dev = collective_device(c.dp_group)
    vec = torch.tensor([float(counts.get(k, 0.0)) for k in keys], dtype=torch.float64, device=dev)
    mins = torch.tensor([float(extrema.get("ratio_min", float("inf"))),
                         -float(extrema.get("ratio_max", float("-inf")))], dtype=torch.float64,
                        device=dev)
    vec = broadcast_from_last_stage(vec if ps.is_pipeline_last_stage() else None,
                                    vec.shape, torch.float64, dev)
    mins = broadcast_from_last_stage(mins if ps.is_pipeline_last_stage() else None,
                                     mins.shape, torch.float64, dev)
    vec = _dp_all_reduce(vec, c.dp_group)
    mins = _dp_all_reduce(mins, c.dp_group, dist.ReduceOp.MIN)
    total = dict(zip(keys, vec))
    present = {k: v for k, v in total.items() if k in counts or float(v) != 0.0}
    out = {f"loss/{k}": float(v) for k, v in finalize_metrics(present).items()}
    out["loss/ratio_min"], out["loss/ratio_max"] = float(mins[0]), float(-mins[1])
    out["tokens"] = float(total.get("tokens", 0.0))
    # the denominators of the A<0 / A>0 rates: a rate of a step without such tokens reads 0.0
    # (rl/diagnostics.py), and averages over steps need to know which steps had any
    out["neg_tokens"], out["pos_tokens"] = float(total.get("neg_tokens", 0.0)), float(total.get("pos_tokens", 0.0))
    return out


def _batch_metrics(c: Components, data: StepData) -> dict[str, float]:
    b = data.batch
    vec = torch.tensor([
        float(data.rewards.sum()), float(data.rewards.numel()),
        float(b.response_lengths.sum()), float((data.rewards >= c.cfg.reward.correct_threshold).sum()),
        float(b.finished.sum()),
    ], dtype=torch.float64, device=collective_device(c.dp_group))
    vec = _dp_all_reduce(vec, c.dp_group)
    n = max(float(vec[1]), 1.0)
    return {"reward_mean": float(vec[0]) / n, "accuracy": float(vec[3]) / n,
            "response_length_mean": float(vec[2]) / n, "eos_fraction": float(vec[4]) / n,
            "sequences": float(vec[1])}
