"""The probe's model side: building (or loading) the model, batching sequences in a micro-batch
layout, the supervised warm-up of a random model, and the direction of the synthetic update."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from megatron_calibclip.parallel.devices import HOST, model_device
from megatron_calibclip.probe.config import ProbeConfig, ProbeError
from megatron_calibclip.probe.weights import dither_weights, rounding_tie_fractions


def pad_batch(seqs: list[torch.Tensor], pad_id: int, device: torch.device) -> torch.Tensor:
    """Right-padded batch on `device` (the model's) of host-side sequences."""
    batch = torch.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=torch.long,
                       device=device)
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
        batch = pad_batch([seqs[i] for i in mb], pad_id, model_device(model))
        lp = shifted_logprobs_entropy(forward_logits(model, batch), batch, vocab)[0]
        for j, i in enumerate(mb):
            out[i] = lp[j, :len(seqs[i]) - 1].detach().float()
    return torch.cat(out)  # type: ignore[arg-type]


def warmup(model, seqs: list[torch.Tensor], cfg: ProbeConfig, steps: int, vocab: int,
            pad_id: int) -> list[float]:
    """Supervised next-token training in fp32 with Adam (random-weight models only)."""
    from megatron_calibclip.models import forward_logits, shifted_logprobs_entropy

    opt = torch.optim.Adam(model.parameters(), lr=cfg.warmup_lr)
    g = torch.Generator(device=HOST).manual_seed(cfg.seed + 5)  # the same draws everywhere
    losses = []
    for _ in range(steps):
        idx = torch.randperm(len(seqs), generator=g, device=HOST)[:cfg.warmup_batch].tolist()
        batch = pad_batch([seqs[i] for i in idx], pad_id, model_device(model))
        mask = torch.zeros(batch.shape[0], batch.shape[1] - 1, device=batch.device)
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


def update_direction(model, seqs, layout, adv_tok, vocab, pad_id) -> dict[str, torch.Tensor]:
    """sign of the fp32 gradient of the synthetic policy-gradient loss (Adam's first step)."""
    from megatron_calibclip.models import forward_logits, shifted_logprobs_entropy

    model.zero_grad(set_to_none=True)
    offsets, pos = [], 0
    for s in seqs:
        offsets.append(pos)
        pos += len(s) - 1
    n_tok = max(int((adv_tok != 0).sum()), 1)
    for mb in layout:
        batch = pad_batch([seqs[i] for i in mb], pad_id, model_device(model))
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


def build_model(cfg: ProbeConfig, log: Callable[[str], None]):
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
