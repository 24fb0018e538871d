"""The FP8 noise probe: static log-prob error and importance-ratio noise per FP8 recipe.

Why: Calibrated Clipping exists because FP8 spreads the PPO ratio r = pi/pi_old far more than
BF16 does. This probe measures that spread on one model and one batch, for every recipe side
by side, with fp32 as the truth and BF16 beside FP8 (BF16 weight rounding is itself noisy
against fp32), separating the noise sources of the SPEC ("Where FP8 ratio noise comes from"):

- static: per-token |logp_fp8 - logp_bf16| (and each precision against fp32), bucketed by the
  token's fp32 probability;
- source "layout": same weights; old log-probs computed in one micro-batch layout (A:
  consecutive groups of `old_micro_batch`), current ones in another (B: groups of
  `micro_batch` after a seeded shuffle). Padding differs too (each micro-batch is right-padded
  to its own longest sequence). fp32, BF16 and per-token/per-tile recipes give r == 1 exactly;
  tensorwise and delayed scales couple a token to its neighbours (mechanism 2);
- source "update_lr<lr>": one small optimizer-like step on the master weights, then the
  current log-probs in layout A again (mechanism 1: FP8 weights re-quantized from the master
  weights at every forward; most of them do not move at RL learning rates, a few jump).

The update is Adam's first step on a synthetic policy-gradient loss: with bias correction,
Adam's first update is lr * m / sqrt(v) = lr * sign(g), so w <- w - lr * sign(g), where g is
the fp32 gradient of -sum_t A_t logp_t / n_tokens over layout A with the synthetic
advantages (every parameter moves by exactly lr, the direction a real step would take).

Synthetic advantages: each sequence gets A = -1 with probability `neg_frac`, else +1 (seeded),
for all of its tokens (GRPO-style sequence-level advantages). Reported per source and
precision: the std of log r against fp32's log r (and against BF16's), the lower-clip rate of
negative-advantage tokens (r < 1 - eps_low), the upper-clip rate of positive ones
(r > 1 + eps_high), and the phantom-clip rate: the fraction of negative-advantage tokens
whose ratio in this precision falls below 1 - eps_low while BF16's (or fp32's) does not.

Token samples (`tokens`): "chain_sum" = reasoning-gym chain_sum problems, question + " " +
answer, every position measured, with `corrupt` (5%) of the positions replaced by uniform
random ids as a stand-in for the unlikely tokens sampling produces; "samples" = chain_sum
questions followed by responses sampled from the model itself (fp32, KV-cached rollout
engine, temperature `temperature`), only the response tokens measured, as in RL; "random" =
uniform ids. Tokenised by bytes (id = byte + 3; pad 0, BOS 1, EOS 2; needs vocab >= 259), or
with the HF tokenizer (and chat template) of a `load`ed folder. A randomly initialised model
predicts every token with p ~ 1/vocab, so by default a random model of <= 10M parameters first
gets a short supervised warm-up (Adam, fp32) on other chain_sum problems, which gives it a
realistic spread of token probabilities (p ~ 1 on the fixed question text, lower on digits).

Runs single-process at TP=1 (inside an initialised model-parallel world).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

PROB_EDGES: tuple[float, ...] = (0.0, 0.01, 0.1, 0.5, 1.0)
GRANULARITIES: tuple[str, ...] = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")
TOKEN_SOURCES: tuple[str, ...] = ("chain_sum", "samples", "random")
# probe.emulation -> (FP8Recipe.weight_source, FP8Recipe.activation_precision)
EMULATIONS = {"bf16_stack": ("bf16", "bf16"), "bf16_weights": ("bf16", "fp32"),
              "gemm_only": ("fp32", "fp32")}
PAD_ID, BOS_ID, EOS_ID, BYTE_OFFSET = 0, 1, 2, 3  # byte tokenisation
SMALL_MODEL_PARAMS = 10_000_000  # random-weight models up to this size get a warm-up by default
DEFAULT_WARMUP_STEPS = 60


class ProbeError(ValueError):
    """A probe setting is invalid, or what it needs is missing; the message says which."""


@dataclass(frozen=True)
class ProbeConfig:
    # Model preset (megatron_calibclip.models.PRESETS) built with random weights (seed), or,
    # with `load`, the architecture read from the HF folder's config.json.
    model: str = "tiny"
    # Hugging Face folder (config.json + *.safetensors) loaded through megatron_calibclip.
    # checkpoint (HFSource / load_hf_into_model); None = random weights.
    load: Optional[str] = None
    # FP8 granularities compared side by side (forward GEMMs in E4M3; the probe runs no FP8
    # backward, so the hybrid format would give the same numbers).
    recipes: tuple[str, ...] = GRANULARITIES
    # "chain_sum": reasoning-gym chain_sum question + answer text (every position measured);
    # "samples": chain_sum questions + responses sampled from the model (fp32, KV-cached
    # rollout engine), only response tokens measured (as in RL); "random": uniform token ids.
    tokens: str = "chain_sum"
    # Number of sequences in the probed batch.
    num_seqs: int = 32
    # Longest sequence in tokens (text is truncated); random tokens: lengths in [max/2, max].
    max_len: int = 128
    # samples only: response length limit (tokens, EOS included) and sampling temperature.
    sample_len: int = 48
    temperature: float = 1.0
    # chain_sum only: fraction of the probed positions (after the first) replaced by uniform
    # random token ids, a stand-in for the unlikely tokens sampling produces (they populate
    # the p < 0.01 bucket; a model that read only clean text gives them p ~ 1e-4).
    corrupt: float = 0.05
    # Layout A (old log-probs): consecutive micro-batches of this many sequences.
    old_micro_batch: int = 8
    # Layout B (current log-probs): micro-batches of this many sequences after a shuffle.
    micro_batch: int = 4
    # Learning rates of the one-step "update" sources (w <- w - lr * sign(grad)).
    lrs: tuple[float, ...] = (1e-6, 1e-5)
    # PPO lower clip: a negative-advantage token is clipped when r < 1 - eps_low.
    eps_low: float = 0.2
    # PPO upper clip: a positive-advantage token is clipped when r > 1 + eps_high.
    eps_high: float = 0.28
    # Fraction of sequences given advantage -1 (the others +1).
    neg_frac: float = 0.5
    # Supervised warm-up steps before probing (fp32, Adam). None = DEFAULT_WARMUP_STEPS for a
    # random-weight model of <= SMALL_MODEL_PARAMS parameters, else 0.
    warmup_steps: Optional[int] = None
    # Adam learning rate of the warm-up.
    warmup_lr: float = 3e-3
    # Sequences per warm-up step (drawn from 4x as many problems as the probe batch, seeded).
    warmup_batch: int = 16
    # With `load`: shift fp32 weights lying exactly halfway between two bf16 values by a
    # seeded random amount below half a bf16 step (checkpoint.ties); None = leave them.
    break_bf16_ties: Optional[int] = None
    # Move weights that sit exactly on a bf16 or E4M3 (power-of-two scale) rounding tie by a
    # seeded amount below half a bf16 step, keeping their bf16 values (dither_weights()); None =
    # leave them. Checkpoints stored in bf16 or 4-bit GGUF are full of such ties.
    dither_weights: Optional[int] = None
    # Seed of the weights, data, layouts, advantages and warm-up.
    seed: int = 0
    # What the bf16 and fp8 rows emulate: "bf16_stack" (default: bf16 model copy quantized,
    # activations bf16 between modules, as megatron + TE on GPU), "bf16_weights" (bf16 copy
    # quantized, fp32 activations) or "gemm_only" (fp32 masters quantized, only GEMM operands
    # rounded: the emulation before the bf16 stack). Side by side, they attribute the noise.
    emulation: str = "bf16_stack"

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipes", parse_recipes(self.recipes))
        object.__setattr__(self, "lrs", tuple(float(v) for v in self.lrs))
        if self.load is None:
            from megatron_calibclip.models.config import PRESETS

            if self.model not in PRESETS:
                raise ProbeError(f"probe.model: {self.model!r} is not one of {sorted(PRESETS)} "
                                 f"(or give --load HF_DIR)")
        if self.tokens not in TOKEN_SOURCES:
            raise ProbeError(f"probe.tokens: {self.tokens!r} is not one of {list(TOKEN_SOURCES)}")
        if self.emulation not in EMULATIONS:
            raise ProbeError(f"probe.emulation: {self.emulation!r} is not one of {list(EMULATIONS)}")
        if not self.temperature > 0:
            raise ProbeError(f"probe.temperature: must be > 0, got {self.temperature}")
        for name in ("num_seqs", "old_micro_batch", "micro_batch", "warmup_batch", "sample_len"):
            if getattr(self, name) < 1:
                raise ProbeError(f"probe.{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_len < 4:
            raise ProbeError(f"probe.max_len: must be >= 4, got {self.max_len}")
        if not self.lrs or any(not (lr > 0 and math.isfinite(lr)) for lr in self.lrs):
            raise ProbeError(f"probe.lrs: need one or more positive learning rates, got "
                             f"{list(self.lrs)}")
        if not 0 < self.eps_low < 1:
            raise ProbeError(f"probe.eps_low: must be in (0, 1), got {self.eps_low}")
        if not self.eps_high > 0:
            raise ProbeError(f"probe.eps_high: must be > 0, got {self.eps_high}")
        if not 0 <= self.corrupt < 1:
            raise ProbeError(f"probe.corrupt: must be in [0, 1), got {self.corrupt}")
        if not 0 < self.neg_frac <= 1:
            raise ProbeError(f"probe.neg_frac: must be in (0, 1], got {self.neg_frac}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ProbeError(f"probe.warmup_steps: must be >= 0, got {self.warmup_steps}")


def parse_recipes(spec: str | Sequence[str]) -> tuple[str, ...]:
    """"all" | "tensorwise,blockwise" | a list of names -> validated granularities, in the
    canonical order, without duplicates."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for item in items:
        for name in str(item).split(","):
            name = name.strip()
            if not name:
                continue
            if name == "all":
                names.extend(GRANULARITIES)
            elif name in GRANULARITIES:
                names.append(name)
            else:
                raise ProbeError(f"probe.recipes: {name!r} is not one of "
                                 f"{list(GRANULARITIES) + ['all']}")
    if not names:
        raise ProbeError("probe.recipes: no recipe given")
    return tuple(g for g in GRANULARITIES if g in names)


# ------------------------------------------------------------------------ statistics
def bucket_stats(p_ref: torch.Tensor, value: torch.Tensor,
                 edges: Sequence[float] = PROB_EDGES) -> dict[str, Any]:
    """Mean and median of `value` per probability bucket [edges[i], edges[i+1]) (the last
    bucket includes 1.0), plus counts and the overall mean."""
    p, v = p_ref.double().flatten(), value.double().flatten()
    means, medians, counts = [], [], []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        last = i == len(edges) - 2
        sel = (p >= lo) & ((p <= hi) if last else (p < hi))
        n = int(sel.sum())
        counts.append(n)
        means.append(float(v[sel].mean()) if n else None)
        medians.append(float(v[sel].median()) if n else None)
    return {"mean": means, "median": medians, "count": counts, "all_mean": float(v.mean())}


def ratio_stats(log_r: torch.Tensor, log_r_bf16: torch.Tensor, log_r_fp32: torch.Tensor,
                adv: torch.Tensor, eps_low: float, eps_high: float) -> dict[str, float]:
    """Ratio noise and clip rates of one precision for one source (all per-token tensors).

    A token is lower-clipped when r < 1 - eps_low (counted over A < 0) and upper-clipped when
    r > 1 + eps_high (over A > 0); phantom_vs_X = P(r < 1 - eps_low and r_X >= 1 - eps_low |
    A < 0): clipped here but not in the reference precision X."""
    lr, r16, r32 = log_r.double(), log_r_bf16.double(), log_r_fp32.double()
    neg, pos = adv < 0, adv > 0
    lo = 1.0 - eps_low
    clipped = torch.exp(lr) < lo
    n_neg, n_pos = max(int(neg.sum()), 1), max(int(pos.sum()), 1)

    def frac(mask: torch.Tensor, of: torch.Tensor, n: int) -> float:
        return float((mask & of).sum()) / n

    return {
        "noise_std_vs_fp32": float((lr - r32).std(unbiased=False)),
        "noise_mean_abs_vs_fp32": float((lr - r32).abs().mean()),
        "noise_std_vs_bf16": float((lr - r16).std(unbiased=False)),
        "log_ratio_std": float(lr.std(unbiased=False)),
        "ratio_ne_1_frac": float((lr != 0).double().mean()),
        "clip_low_rate_neg": frac(clipped, neg, n_neg),
        "clip_high_rate_pos": frac(torch.exp(lr) > 1.0 + eps_high, pos, n_pos),
        "phantom_vs_bf16": frac(clipped & ~(torch.exp(r16) < lo), neg, n_neg),
        "phantom_vs_fp32": frac(clipped & ~(torch.exp(r32) < lo), neg, n_neg),
    }


# ------------------------------------------------------------------------ data
def _byte_ids(text: str) -> list[int]:
    return [BYTE_OFFSET + b for b in text.encode("utf-8")]


def _chain_sum(n: int, seed: int) -> list[tuple[str, str]]:
    from megatron_calibclip.data import reasoning_gym_records

    return [(r.prompt, r.answer) for r in reasoning_gym_records("chain_sum", n, seed)]


class _Tokens:
    """Byte tokens (id = byte + 3; pad 0, BOS 1, EOS 2) or an HF tokenizer, one interface."""

    def __init__(self, vocab_size: int, tokenizer=None):
        self.tok = tokenizer
        if tokenizer is None and vocab_size < BYTE_OFFSET + 256:
            raise ProbeError(f"byte tokens need a vocabulary of >= {BYTE_OFFSET + 256}, the "
                             f"model has {vocab_size}")
        self.pad = tokenizer.pad_id if tokenizer is not None else PAD_ID
        self.eos = tokenizer.eos_id if tokenizer is not None else EOS_ID
        self.special_lo = 0 if tokenizer is not None else BYTE_OFFSET

    def text(self, text: str) -> list[int]:
        if self.tok is None:
            return [BOS_ID] + _byte_ids(text)
        return list(self.tok.encode(text))

    def prompt(self, question: str) -> list[int]:
        """What a response is sampled after: the chat template for HF instruct models."""
        if self.tok is None:
            return [BOS_ID] + _byte_ids(question + " ")
        template = getattr(self.tok, "apply_chat_template", None)
        if template is not None and getattr(getattr(self.tok, "_tok", None), "chat_template",
                                            None):
            return list(self.tok.encode(template(question)))
        return list(self.tok.encode(question + " "))


def make_sequences(cfg: ProbeConfig, n: int, seed: int, vocab_size: int, tokenizer=None,
                   corrupt: float = 0.0, eos: bool = False) -> list[torch.Tensor]:
    """n token sequences (1-D LongTensors, length >= 2): chain_sum question + answer text (EOS
    appended if `eos`), or random ids (tokens == "random"); with `corrupt` > 0 (text only)
    that fraction of positions >= 1 gets uniform random ids."""
    if cfg.tokens == "random":
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(cfg.max_len // 2, cfg.max_len + 1, (n,), generator=g)
        return [torch.randint(1, vocab_size, (int(L),), generator=g) for L in lengths]
    toks = _Tokens(vocab_size, tokenizer)
    seqs = [(toks.text(f"{q} {a}") + ([toks.eos] if eos else []))[:cfg.max_len]
            for q, a in _chain_sum(n, seed)]
    out = [torch.tensor(s, dtype=torch.long) for s in seqs if len(s) >= 2]
    if corrupt > 0:
        g = torch.Generator().manual_seed(seed + 29)
        for s in out:
            hit = torch.rand(len(s), generator=g) < corrupt
            hit[0] = False
            s[hit] = torch.randint(toks.special_lo, vocab_size, (int(hit.sum()),), generator=g)
    return out


def make_samples(model, cfg: ProbeConfig, n: int, seed: int, vocab_size: int, tokenizer=None
                 ) -> tuple[list[torch.Tensor], list[int]]:
    """chain_sum questions + responses sampled from the model in its current precision;
    returns the sequences and, per sequence, the index of its first response token."""
    from megatron_calibclip.rollout import MegatronRolloutEngine, SamplingParams

    toks = _Tokens(vocab_size, tokenizer)
    prompts = [toks.prompt(q)[-(cfg.max_len - 1):] for q, _ in _chain_sum(n, seed)]
    engine = MegatronRolloutEngine(model, vocab_size, toks.eos, toks.pad)
    batch = engine.generate(prompts, SamplingParams(temperature=cfg.temperature,
                                                    max_new_tokens=cfg.sample_len), seed)
    seqs, starts = [], []
    for i, response in enumerate(batch.responses()):
        seqs.append(torch.tensor(prompts[i] + response, dtype=torch.long))
        starts.append(len(prompts[i]))
    return seqs, starts


def make_layouts(n: int, old_mb: int, new_mb: int, seed: int
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """Layout A: consecutive groups of old_mb; layout B: groups of new_mb after a shuffle."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 17)).tolist()
    a = [list(range(i, min(i + old_mb, n))) for i in range(0, n, old_mb)]
    b = [order[i:i + new_mb] for i in range(0, n, new_mb)]
    return a, b


def _pad(seqs: list[torch.Tensor], pad_id: int) -> torch.Tensor:
    batch = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long)
    for j, s in enumerate(seqs):
        batch[j, :len(s)] = s
    return batch


def layout_logprobs(model, seqs: list[torch.Tensor], layout: list[list[int]], vocab: int,
                    pad_id: int) -> torch.Tensor:
    """Per-token next-token log-probs of every sequence, computed micro-batch by micro-batch
    (right-padded to the micro-batch's longest sequence), concatenated in sequence order."""
    from megatron_calibclip.models import forward_logits, shifted_logprobs_entropy

    out: list[Optional[torch.Tensor]] = [None] * len(seqs)
    for mb in layout:
        batch = _pad([seqs[i] for i in mb], pad_id)
        lp = shifted_logprobs_entropy(forward_logits(model, batch), batch, vocab)[0]
        for j, i in enumerate(mb):
            out[i] = lp[j, :len(seqs[i]) - 1].detach().float()
    return torch.cat(out)  # type: ignore[arg-type]


# ------------------------------------------------------------------------ model side
def _warmup(model, seqs: list[torch.Tensor], cfg: ProbeConfig, steps: int, vocab: int,
            pad_id: int) -> list[float]:
    """Supervised next-token training in fp32 with Adam (random-weight models only)."""
    from megatron_calibclip.models import forward_logits, shifted_logprobs_entropy

    opt = torch.optim.Adam(model.parameters(), lr=cfg.warmup_lr)
    g = torch.Generator().manual_seed(cfg.seed + 5)
    losses = []
    for _ in range(steps):
        idx = torch.randperm(len(seqs), generator=g)[:cfg.warmup_batch].tolist()
        batch = _pad([seqs[i] for i in idx], pad_id)
        mask = torch.zeros(batch.shape[0], batch.shape[1] - 1)
        for j, i in enumerate(idx):
            mask[j, :len(seqs[i]) - 1] = 1.0
        lp = shifted_logprobs_entropy(forward_logits(model, batch), batch, vocab)[0]
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.zero_grad(set_to_none=True)
    return losses


def _update_direction(model, seqs, layout, adv_tok, vocab, pad_id) -> dict[str, torch.Tensor]:
    """sign of the fp32 gradient of the synthetic policy-gradient loss (Adam's first step)."""
    from megatron_calibclip.models import forward_logits, shifted_logprobs_entropy

    model.zero_grad(set_to_none=True)
    offsets, pos = [], 0
    for s in seqs:
        offsets.append(pos)
        pos += len(s) - 1
    n_tok = max(int((adv_tok != 0).sum()), 1)
    for mb in layout:
        batch = _pad([seqs[i] for i in mb], pad_id)
        lp = shifted_logprobs_entropy(forward_logits(model, batch), batch, vocab)[0]
        weight = torch.zeros_like(lp)
        for j, i in enumerate(mb):
            n = len(seqs[i]) - 1
            weight[j, :n] = adv_tok[offsets[i]:offsets[i] + n]
        (-(weight * lp).sum() / n_tok).backward()
    direction = {n: torch.sign(p.grad.detach()) for n, p in model.named_parameters()
                 if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return direction


def _gemm_weights(model, mode: str) -> list[torch.Tensor]:
    """The weights of the emulated linears as their GEMMs see them in `mode`."""
    from megatron_calibclip.fp8 import emulated_linears
    from megatron_calibclip.fp8.formats import round_to_bf16

    linears = emulated_linears(model)
    if mode == "fp32":
        return [m.weight.detach().clone() for m in linears]
    if mode == "bf16":
        return [round_to_bf16(m.weight.detach()) for m in linears]
    return [m.quantized_weight() if m.effective_mode() == "fp8" else round_to_bf16(m.weight)
            for m in linears]


def _changed_fraction(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    changed = sum(int((a != b).sum()) for a, b in zip(after, before))
    return changed / max(sum(b.numel() for b in before), 1)


def rounding_tie_fractions(model, recipes: Sequence[str]) -> dict[str, Optional[float]]:
    """Fraction of the emulated linears' weights that sit exactly on a rounding tie: halfway
    between two bf16 values ("bf16"), or, after the recipe's weight scale, halfway between two
    E4M3 values (per recipe; None for delayed, whose scale depends on history). Any update
    moves all tied weights the same way (round-half-even flips with the update's sign), which
    fakes ratio noise. With power-of-two scales (blockwise, mxfp8) every bf16-exact weight
    whose 4 low bf16 mantissa bits are 1000 is an E4M3 tie (~6% of a bf16 checkpoint)."""
    from megatron_calibclip.fp8 import E4M3, FP8Recipe, emulated_linears, quantize
    from megatron_calibclip.fp8.formats import round_to_fp8

    weights = [m.weight.detach().float() for m in emulated_linears(model)]
    total = max(sum(w.numel() for w in weights), 1)
    bf16 = sum(int(((w.contiguous().view(torch.int32) & 0xFFFF) == 0x8000).sum())
               for w in weights)
    out: dict[str, Optional[float]] = {"bf16": bf16 / total}
    for name in recipes:
        if name == "delayed":
            out[name] = None
            continue
        recipe, ties = FP8Recipe(granularity=name), 0
        for w in weights:
            q = quantize(w, recipe, "weight")
            scale = q.unblock(torch.ones_like(q.data, dtype=torch.float32) * q.scale)
            scaled = w * scale  # what the kernel rounds (fp32 product, as in quantize)
            up = round_to_fp8(torch.nextafter(scaled, torch.full_like(scaled, math.inf)), E4M3)
            dn = round_to_fp8(torch.nextafter(scaled, torch.full_like(scaled, -math.inf)), E4M3)
            ties += int(((up != dn) & (scaled.abs() < E4M3.max)).sum())
        out[name] = ties / total
    return out


def dither_weights(model, seed: int) -> int:
    """Move every tied weight of the emulated linears off its tie, keeping its bf16 value.

    fp32 bits with low 16 bits 0x8000 (bf16 ties) get 0x8000 +- d; non-zero bf16-exact values
    (low 16 bits 0, which holds every E4M3 tie under a power-of-two scale) get +- d; d in
    [1, 0x7FFF], seeded per tensor. Both stay within half a bf16 step, on the side that rounds
    to the same bf16 value (ties: a random side). Other weights are unchanged. Returns the
    number of weights moved."""
    from megatron_calibclip.fp8 import emulated_linears

    moved = 0
    with torch.no_grad():
        for i, m in enumerate(emulated_linears(model)):
            w = m.weight
            g = torch.Generator().manual_seed(seed * 1_000_003 + i)
            bits = w.detach().float().contiguous().view(torch.int32).clone()
            low = bits & 0xFFFF
            tie = low == 0x8000
            exact = (low == 0) & (w.detach() != 0)
            d = torch.randint(1, 0x8000, bits.shape, generator=g, dtype=torch.int32)
            d = d * (torch.randint(0, 2, bits.shape, generator=g, dtype=torch.int32) * 2 - 1)
            bits = torch.where(tie, (bits & ~0xFFFF) | (0x8000 + d), bits)
            bits = torch.where(exact, bits + d, bits)
            w.copy_(bits.view(torch.float32).to(w.dtype))
            moved += int(tie.sum() + exact.sum())
    return moved


def _build_model(cfg: ProbeConfig, log: Callable[[str], None]):
    """(model, ModelConfig, tokenizer or None, model info dict)."""
    from megatron_calibclip.fp8 import fp8_linear_classes
    from megatron_calibclip.models import build_policy_model, get_preset, local_layer_spec

    info: dict[str, Any] = {"preset": cfg.model, "loaded_from": cfg.load}
    tokenizer = None
    if cfg.load is None:
        mcfg = get_preset(cfg.model)
        model = build_policy_model(mcfg, spec=local_layer_spec(mcfg, **fp8_linear_classes()),
                                   seed=cfg.seed)
        info["weights"] = f"random (seed {cfg.seed})"
    else:
        try:
            from megatron_calibclip.checkpoint.hf_to_mcore import HFSource, load_hf_into_model
        except ImportError as err:  # the conversion package is optional here
            raise ProbeError(f"--load needs megatron_calibclip.checkpoint's HF loader: {err}") \
                from err
        source = HFSource(cfg.load)
        mcfg = source.cfg
        model = build_policy_model(mcfg, spec=local_layer_spec(mcfg, **fp8_linear_classes()))
        load_hf_into_model(model, source)
        info["weights"] = f"Hugging Face folder {cfg.load}"
        preset = None
        try:
            preset = get_preset(cfg.model)
        except Exception:  # noqa: BLE001 - a non-preset name is only a label here
            pass
        if preset is not None and (preset.hidden_size, preset.num_layers) != \
                (mcfg.hidden_size, mcfg.num_layers):
            log(f"note: {cfg.load} is not the {cfg.model} architecture; probing what was loaded")
        from pathlib import Path

        if any((Path(cfg.load) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            from megatron_calibclip.data import HFTokenizer

            tokenizer = HFTokenizer(cfg.load)
    if cfg.dither_weights is not None or cfg.break_bf16_ties is not None:
        info["rounding_tie_frac_before"] = rounding_tie_fractions(model, cfg.recipes)
    if cfg.break_bf16_ties is not None:  # the conversion tool's bf16-only tie breaking
        from megatron_calibclip.checkpoint.ties import break_bf16_ties

        params = dict(model.named_parameters())
        fixed, counts = break_bf16_ties({n: p.detach() for n, p in params.items()},
                                        cfg.break_bf16_ties)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(fixed[n])
        info["bf16_ties_broken"] = int(sum(counts.values()))
    if cfg.dither_weights is not None:
        info["dithered_weights"] = dither_weights(model, cfg.dither_weights)
    info["rounding_tie_frac"] = rounding_tie_fractions(model, cfg.recipes)
    worst = max(((k, v) for k, v in info["rounding_tie_frac"].items() if v is not None),
                key=lambda kv: kv[1])
    if worst[1] > 1e-3:
        log(f"warning: {100 * worst[1]:.2f}% of the linear weights sit exactly on a {worst[0]} "
            f"rounding tie (fractions: {info['rounding_tie_frac']}); an update moves them all "
            f"the same way and fakes ratio noise. --dither-weights SEED moves them off "
            f"(keeping every bf16 value)")
    info["num_parameters"] = mcfg.num_parameters()
    info["config"] = dataclasses.asdict(mcfg)
    return model, mcfg, tokenizer, info


# ------------------------------------------------------------------------ the probe
def _source_name(lr: float) -> str:
    return f"update_lr{lr:g}"


def run_fp8_noise(cfg: ProbeConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the probe (TP=1, model-parallel world initialised); returns the JSON-ready result."""
    from megatron.core import parallel_state

    from megatron_calibclip.fp8 import FP8Recipe, reset_fp8_state, set_precision

    if parallel_state.get_tensor_model_parallel_world_size() != 1:
        raise ProbeError("the fp8-noise probe runs at TP=1 (one process)")
    t0 = time.perf_counter()
    timing: dict[str, float] = {}
    torch.manual_seed(cfg.seed)
    model, mcfg, tokenizer, model_info = _build_model(cfg, log)
    vocab = mcfg.vocab_size
    pad_id = tokenizer.pad_id if tokenizer is not None else PAD_ID
    if cfg.tokens != "random":
        _Tokens(vocab, tokenizer)  # fail early: byte tokens need a vocabulary >= 259
    timing["build"] = time.perf_counter() - t0

    random_weights = cfg.load is None
    steps = cfg.warmup_steps
    if steps is None:
        steps = DEFAULT_WARMUP_STEPS if random_weights and \
            mcfg.num_parameters() <= SMALL_MODEL_PARAMS else 0
    set_precision(model, "fp32")
    warm = {"steps": steps, "lr": cfg.warmup_lr, "loss_first": None, "loss_last": None}
    if steps > 0:
        t = time.perf_counter()
        train = make_sequences(cfg, 4 * cfg.num_seqs, cfg.seed + 1000, vocab, tokenizer,
                               eos=cfg.tokens == "samples")
        losses = _warmup(model, train, cfg, steps, vocab, pad_id)
        warm.update(loss_first=losses[0], loss_last=losses[-1])
        timing["warmup"] = time.perf_counter() - t
        log(f"warm-up: {steps} Adam steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model.eval()

    corrupt = cfg.corrupt if cfg.tokens == "chain_sum" else 0.0
    if cfg.tokens == "samples":
        t = time.perf_counter()
        with torch.no_grad():
            seqs, starts = make_samples(model, cfg, cfg.num_seqs, cfg.seed, vocab, tokenizer)
        timing["sampling"] = time.perf_counter() - t
    else:
        seqs = make_sequences(cfg, cfg.num_seqs, cfg.seed, vocab, tokenizer, corrupt)
        starts = [1] * len(seqs)
    if len(seqs) < 2:
        raise ProbeError("fewer than 2 usable sequences (length >= 2); raise num_seqs/max_len")
    layout_a, layout_b = make_layouts(len(seqs), cfg.old_micro_batch, cfg.micro_batch, cfg.seed)
    # measured positions: next-token position t scores token t + 1; a sequence's tokens from
    # index starts[i] on are measured (text: all but the first token; samples: the response)
    measured = torch.cat([torch.arange(len(s) - 1) >= starts[i] - 1 for i, s in enumerate(seqs)])
    g = torch.Generator().manual_seed(cfg.seed + 3)
    seq_adv = torch.where(torch.rand(len(seqs), generator=g) < cfg.neg_frac, -1.0, 1.0)
    adv_all = torch.cat([seq_adv[i].expand(len(s) - 1) for i, s in enumerate(seqs)])
    adv_all = torch.where(measured, adv_all, torch.zeros_like(adv_all))
    adv = adv_all[measured]

    t = time.perf_counter()
    direction = _update_direction(model, seqs, layout_a, adv_all, vocab, pad_id)
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    timing["direction"] = time.perf_counter() - t

    def apply_update(lr: float) -> None:
        with torch.no_grad():
            for n, d in direction.items():
                params[n].copy_(master[n] - lr * d)

    def restore() -> None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(master[n])

    weights, activations = EMULATIONS[cfg.emulation]
    options = dict(weight_source=weights, activation_precision=activations)
    precisions = [("fp32", "fp32", None), ("bf16", "bf16", FP8Recipe(**options))] + [
        (gname, "fp8", FP8Recipe(granularity=gname, **options)) for gname in cfg.recipes]
    logp: dict[str, dict[str, torch.Tensor]] = {}
    changed: dict[str, dict[str, float]] = {_source_name(lr): {} for lr in cfg.lrs}
    with torch.no_grad():
        for key, mode, recipe in precisions:
            t = time.perf_counter()
            set_precision(model, mode, recipe)
            reset_fp8_state(model)
            if recipe is not None and recipe.granularity == "delayed":
                # scales come from earlier steps: fill the amax history with this batch first
                layout_logprobs(model, seqs, layout_a, vocab, pad_id)
            def run(layout):
                return layout_logprobs(model, seqs, layout, vocab, pad_id)[measured]

            res = {"old": run(layout_a), "layout": run(layout_b)}
            before = _gemm_weights(model, mode)
            for lr in cfg.lrs:
                apply_update(lr)
                changed[_source_name(lr)][key] = _changed_fraction(before, _gemm_weights(model,
                                                                                         mode))
                res[_source_name(lr)] = run(layout_a)
                restore()
            logp[key] = res
            timing[key] = time.perf_counter() - t
        set_precision(model, "fp32")

    # ---- statistics
    lp32, lp16 = logp["fp32"]["old"], logp["bf16"]["old"]
    p_ref = torch.exp(lp32.double())
    static: dict[str, Any] = {
        "bf16": {"vs_fp32": bucket_stats(p_ref, (lp16 - lp32).abs()),
                 "err_std_vs_fp32": float((lp16 - lp32).double().std(unbiased=False))}}
    for key in cfg.recipes:
        lp8 = logp[key]["old"]
        static[key] = {"vs_bf16": bucket_stats(p_ref, (lp8 - lp16).abs()),
                       "vs_fp32": bucket_stats(p_ref, (lp8 - lp32).abs()),
                       "err_std_vs_fp32": float((lp8 - lp32).double().std(unbiased=False))}
    sources: dict[str, Any] = {}
    for src in ["layout"] + [_source_name(lr) for lr in cfg.lrs]:
        log_r = {key: logp[key][src] - logp[key]["old"] for key in logp}
        sources[src] = {key: ratio_stats(log_r[key], log_r["bf16"], log_r["fp32"], adv,
                                         cfg.eps_low, cfg.eps_high) for key in log_r}
    timing["total"] = time.perf_counter() - t0
    labels = [f"[{lo:g}, {hi:g}{']' if i == len(PROB_EDGES) - 2 else ')'}"
              for i, (lo, hi) in enumerate(zip(PROB_EDGES[:-1], PROB_EDGES[1:]))]
    return {
        "probe": "fp8-noise",
        "config": dataclasses.asdict(cfg),
        "model": model_info,
        "data": {
            "tokens": {
                "chain_sum": "reasoning-gym chain_sum question + answer text, all positions",
                "samples": f"reasoning-gym chain_sum questions + responses sampled from the "
                           f"model (fp32, T={cfg.temperature:g}, <= {cfg.sample_len} tokens); "
                           f"response tokens only",
                "random": "uniform random token ids"}[cfg.tokens],
            "tokenizer": "none" if cfg.tokens == "random" else
            ("the HF folder's tokenizer" if tokenizer is not None else
             f"bytes (id = byte + {BYTE_OFFSET}, pad {PAD_ID}, BOS {BOS_ID}, EOS {EOS_ID})"),
            "corrupted_frac": corrupt,
            "num_seqs": len(seqs),
            "num_tokens": int(adv.numel()),
            "num_neg_tokens": int((adv < 0).sum()),
            "seq_len_min": min(len(s) for s in seqs),
            "seq_len_max": max(len(s) for s in seqs),
            "layout_old_micro_batches": [len(mb) for mb in layout_a],
            "layout_new_micro_batches": [len(mb) for mb in layout_b],
            "padding": "right, to each micro-batch's longest sequence",
        },
        "warmup": warm,
        "update": {"rule": "w <- w - lr * sign(grad): Adam's first step on the fp32 gradient "
                           "of -sum(A * logp) / n_tokens (layout A)", "lrs": list(cfg.lrs)},
        "prob_buckets": {"edges": list(PROB_EDGES), "labels": labels,
                         "by": "the token's fp32 probability (old weights, layout A)",
                         "count": bucket_stats(p_ref, p_ref)["count"]},
        "static": static,
        "sources": sources,
        "gemm_weights_changed_frac": changed,
        "timing_s": {k: round(v, 3) for k, v in timing.items()},
    }
