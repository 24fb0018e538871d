"""`calibclip plan`: which TP/PP/DP layouts of a model fit on H100s, and which one to use.

The lead's cli.py registers it with `add_plan_parser(sub)`; `run_plan(args)` returns the
exit status: 0 when a layout fits (or the recipe's layout fits), 1 when none does, 2 for
bad input. Imports stay inside run_plan so `calibclip --help` stays fast.
"""
from __future__ import annotations

import argparse
import json
import sys

EXIT_NO_FIT = 1
EXIT_BAD_INPUT = 2


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="per-GPU memory of RL training layouts (TP/PP/DP) on 80 GB H100s",
        description="Estimate per-GPU memory (policy weights, FP8 caches, gradients, optimizer "
                    "with/without the distributed optimizer, activations with/without "
                    "recomputation, BF16 reference resident/offloaded, rollout KV cache) for "
                    "every TP/PP/DP layout of a model on N GPUs; list those that fit and "
                    "recommend one. See docs/planner.md.")
    p.add_argument("--model", help="model preset (calibclip presets), e.g. qwen3-32b")
    p.add_argument("--gpus", type=int, help="number of GPUs")
    p.add_argument("--recipe", help="a recipe YAML with a '# sbatch:' header: plan its layout "
                                    "(and list the alternatives)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe value (repeatable), as in calibclip train")
    p.add_argument("--crosscheck", action="store_true",
                   help="print the comparison with published memory figures and exit")
    w = p.add_argument_group("workload")
    w.add_argument("--seq", type=int, default=4096, help="prompt + response tokens (4096)")
    w.add_argument("--prompt-len", type=int, default=None,
                   help="prompt tokens, the prefill length (default: min(1024, seq/4))")
    w.add_argument("--micro-batch", type=int, default=1, help="sequences per update micro-batch")
    w.add_argument("--logprob-micro-batch", type=int, default=4,
                   help="sequences per log-prob forward (4)")
    w.add_argument("--rollout-batch", type=int, default=64,
                   help="sequences one DP rank generates at once (64)")
    w.add_argument("--microbatches", type=int, default=8,
                   help="micro-batches per optimizer step per DP rank (pipeline in-flight bound)")
    lay = p.add_argument_group("layout (default: search)")
    lay.add_argument("--tp", type=int, help="fix the tensor-parallel size")
    lay.add_argument("--pp", type=int, help="fix the pipeline-parallel size")
    lay.add_argument("--recompute", choices=("none", "selective", "full", "any"), default="none",
                     help="activation recomputation (the trainer has none today; 'any' explores)")
    lay.add_argument("--sequence-parallel", action="store_true",
                     help="assume Megatron sequence parallelism (the trainer has it off today)")
    lay.add_argument("--reference", choices=("resident", "offloaded", "any"), default="any",
                     help="BF16 reference model on the GPU, offloaded to the host, or either")
    lay.add_argument("--no-dist-opt", action="store_true", help="no distributed optimizer")
    lay.add_argument("--precision", choices=("fp8", "bf16"), default="fp8",
                     help="trainer GEMMs (fp8 adds weight caches, saves FP8 GEMM inputs)")
    lay.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="fp32",
                     help="main-gradient buffer dtype (trainer: fp32)")
    lay.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--gpus-per-node", type=int, default=8, help="TP stays within a node (8)")
    hw.add_argument("--gpu-memory-gib", type=float, default=None,
                    help="device memory (default: H100 80GB, 79.6 GiB)")
    hw.add_argument("--reserve-gib", type=float, default=6.0,
                    help="kept free for CUDA context, NCCL and fragmentation (6)")
    hw.add_argument("--margin-gib", type=float, default=5.0,
                    help="recommend a layout with this much spare when one exists (5)")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=12, help="rows of the layout table (12)")
    out.add_argument("--all", action="store_true", help="also list layouts that do not fit")
    out.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_plan)
    return p


def _hardware(args):
    from megatron_calibclip.planner.spec import Hardware

    for flag, value, ok, rule in (
            ("--gpus-per-node", args.gpus_per_node, args.gpus_per_node >= 1, ">= 1"),
            ("--reserve-gib", args.reserve_gib, args.reserve_gib >= 0, ">= 0"),
            ("--margin-gib", args.margin_gib, args.margin_gib >= 0, ">= 0"),
            ("--gpu-memory-gib", args.gpu_memory_gib,
             args.gpu_memory_gib is None or args.gpu_memory_gib > 0, "> 0")):
        if not ok:
            raise ValueError(f"{flag} {value} is invalid: it must be {rule}")
    kw = {"gpus_per_node": args.gpus_per_node, "reserve_gib": args.reserve_gib}
    if args.gpu_memory_gib:
        kw["gpu_memory_gib"] = args.gpu_memory_gib
    return Hardware(**kw)


def _run_recipe(args) -> int:
    from dataclasses import replace

    from megatron_calibclip.models.config import get_preset
    from megatron_calibclip.planner import report
    from megatron_calibclip.planner.memory import estimate
    from megatron_calibclip.planner.recipe import read_recipe
    from megatron_calibclip.planner.search import plan, recommend

    r = read_recipe(args.recipe, args.set)
    m = get_preset(r.preset)
    hw = replace(_hardware(args), gpus_per_node=r.gpus_per_node)
    e = estimate(m, r.layout, r.workload, hw, r.preset)
    alternatives = plan(m, r.gpus, r.workload, hw, r.layout, r.preset,
                        recompute=("none",), offload=(False, True))
    best = recommend(alternatives, args.margin_gib)
    if args.json:
        print(json.dumps({"recipe": report.to_json(e, m),
                          "recommended": report.to_json(best, m) if best else None}, indent=1))
    else:
        print(f"recipe {r.path}: {r.preset} on {r.nodes} node(s) x {r.gpus_per_node} GPUs, "
              f"seq {r.workload.seq_len} (prompt {r.workload.prompt_len}), rollout "
              f"{r.workload.rollout_batch} seqs/DP rank\n")
        print(report.breakdown(m, e))
        print("\nlayouts of the trainer as it is today (no SP, no recomputation):")
        print(report.table([a for a in alternatives if a.fits or args.all], args.top))
        if best:
            print(f"\nrecommended: {best.layout.describe()} ({best.peak_gib:.1f} GiB peak)")
    return 0 if e.fits else EXIT_NO_FIT


def run_plan(args: argparse.Namespace) -> int:
    from megatron_calibclip.config import ConfigError

    try:
        if args.crosscheck:
            from megatron_calibclip.planner import crosscheck

            print(crosscheck.table(crosscheck.all_checks()))
            return 0
        if args.recipe:
            return _run_recipe(args)
        if not args.model or args.gpus is None:
            print("calibclip plan: --model and --gpus are required (or --recipe, --crosscheck)",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        if args.gpus < 1:
            print(f"calibclip plan: --gpus must be at least 1, got {args.gpus}", file=sys.stderr)
            return EXIT_BAD_INPUT
        return _run_search(args)
    except (ConfigError, ValueError) as err:
        print(f"calibclip plan: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


MAX_GPUS_SEARCHED = 4096


def _what_would_fit(m, args, workload, hw, base, recompute, offload) -> list[str]:
    """When nothing fits: the memory switches that make a layout fit on these GPUs, and the
    smallest GPU count (same switches) on which one fits."""
    from dataclasses import replace

    from megatron_calibclip.planner.search import plan, recommend

    def best(gpus, lay, rec):
        return recommend(plan(m, gpus, workload, hw, lay, args.model, tp=args.tp, pp=args.pp,
                              recompute=rec, offload=offload), args.margin_gib)

    lines = []
    switches = [("--recompute any", base, None),
                ("--sequence-parallel", replace(base, sequence_parallel=True), recompute),
                ("--kv-cache-dtype fp8", replace(base, kv_cache_dtype="fp8"), recompute),
                ("--recompute any --sequence-parallel --kv-cache-dtype fp8",
                 replace(base, sequence_parallel=True, kv_cache_dtype="fp8"), None)]
    for flags, lay, rec in switches:
        found = best(args.gpus, lay, rec)
        if found is not None:
            lines.append(f"{args.gpus} GPUs with {flags}: {found.layout.describe()} "
                         f"({found.peak_gib:.1f} GiB peak)")
    step = hw.gpus_per_node
    for gpus in [g for g in range(args.gpus + 1, step) if step % g == 0] + \
            list(range(step * (args.gpus // step + 1), MAX_GPUS_SEARCHED + 1, step)):
        found = best(gpus, base, recompute)
        if found is not None:
            lines.append(f"{gpus} GPUs as asked: {found.layout.describe()} "
                         f"({found.peak_gib:.1f} GiB peak)")
            break
    else:
        lines.append(f"no GPU count up to {MAX_GPUS_SEARCHED} fits as asked: shorten --seq / "
                     f"--rollout-batch")
    return lines


def _run_search(args) -> int:
    from megatron_calibclip.models.config import get_preset
    from megatron_calibclip.planner import report
    from megatron_calibclip.planner.search import plan, recommend
    from megatron_calibclip.planner.spec import Layout, Workload

    m = get_preset(args.model)
    if args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    prompt = args.prompt_len if args.prompt_len else min(1024, max(1, args.seq // 4))
    workload = Workload(seq_len=args.seq, prompt_len=prompt, micro_batch=args.micro_batch,
                        logprob_micro_batch=args.logprob_micro_batch,
                        rollout_batch=args.rollout_batch,
                        microbatches_per_step=args.microbatches)
    base = Layout(sequence_parallel=args.sequence_parallel,
                  distributed_optimizer=not args.no_dist_opt, precision=args.precision,
                  grad_dtype=args.grad_dtype, kv_cache_dtype=args.kv_cache_dtype)
    recompute = None if args.recompute == "any" else (args.recompute,)
    offload = {"resident": (False,), "offloaded": (True,), "any": (False, True)}[args.reference]
    hw = _hardware(args)
    estimates = plan(m, args.gpus, workload, hw, base, args.model, tp=args.tp, pp=args.pp,
                     recompute=recompute, offload=offload)
    if not estimates:
        raise ValueError(f"no TP x PP layout of {args.model} divides {args.gpus} GPUs "
                         f"(TP <= {hw.gpus_per_node}, dividing heads/KV groups/FFN)")
    best = recommend(estimates, args.margin_gib)
    if args.json:
        print(json.dumps({"recommended": report.to_json(best, m) if best else None,
                          "layouts": [report.to_json(e, m) for e in estimates
                                      if e.fits or args.all]}, indent=1))
        return 0 if best else EXIT_NO_FIT
    fitting = [e for e in estimates if e.fits]
    print(f"{args.model}: {m.num_parameters() / 1e9:.2f}B parameters on {args.gpus} GPUs "
          f"({hw.gpu_memory_gib:.1f} GiB, {hw.reserve_gib:.1f} reserved); seq {workload.seq_len} "
          f"(prompt {workload.prompt_len}), micro-batch {workload.micro_batch}, rollout "
          f"{workload.rollout_batch} seqs/DP rank, {args.precision.upper()}")
    print(f"{len(fitting)} of {len(estimates)} layouts fit (GiB per GPU, most loaded stage)")
    if fitting or args.all:
        print("\n" + report.table(estimates if args.all else fitting, args.top))
    if best is None:
        print(f"\nnothing fits on {args.gpus} GPUs. The layouts {args.gpus} GPUs allow, "
              f"closest to fitting first:\n")
        print(report.table(estimates, args.top))
        print("\nwhat would fit:")
        for line in _what_would_fit(m, args, workload, hw, base, recompute, offload):
            print(f"  {line}")
        return EXIT_NO_FIT
    print("\nrecommended:\n" + report.breakdown(m, best))
    return 0
