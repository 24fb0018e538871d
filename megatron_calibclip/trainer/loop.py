"""The RL training loop: set up, run steps, log, checkpoint, report.

Checkpointing is a seam: `train(cfg, checkpointer=...)` takes any object with
`load_latest(components) -> Optional[int]` (the last finished step) and
`save(step, components)`; checkpoint/ provides the real one.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional, Protocol

import torch.distributed as dist
import yaml

from megatron_calibclip.config import to_dict
from megatron_calibclip.models import copy_weights
from megatron_calibclip.parallel import initialize_distributed, teardown
from megatron_calibclip.trainer.calibration_report import (
    calibration_line,
    calibration_records,
    calibration_table,
)
from megatron_calibclip.trainer.components import Components, build_components
from megatron_calibclip.trainer.config import TrainConfig
from megatron_calibclip.trainer.metrics import (
    MetricsLogger,
    learning_line,
    plot_summary,
    read_metrics,
    summary_table,
)
from megatron_calibclip.trainer.run_dir import RunDirError, check_run_dir
from megatron_calibclip.trainer.samples import SampleWriter
from megatron_calibclip.trainer.step import train_step


class Checkpointer(Protocol):
    def load_latest(self, components: Components) -> Optional[int]: ...

    def save(self, step: int, components: Components) -> None: ...


def _has_checkpoint(checkpointer) -> bool:
    if checkpointer is None:
        return False
    probe = getattr(checkpointer, "has_checkpoint", None)
    return bool(probe()) if callable(probe) else False


def _warmup(c: Components, cfg: TrainConfig, rank0: bool) -> None:
    from megatron_calibclip.trainer.warmup import run_warmup

    t = time.perf_counter()
    losses = run_warmup(c, cfg.warmup)
    if rank0 and losses:
        print(f"supervised warm-up: {len(losses)} steps, loss {losses[0]:.3f} -> "
              f"{losses[-1]:.3f} ({time.perf_counter() - t:.1f}s)")


def _evaluation(c: Components, step: int, *, before: bool) -> dict[str, float]:
    """Held-out greedy accuracy before steps 0, N, 2N, ... (eval/*) and after the last step
    (eval_final/*), when evaluation.every = N > 0."""
    every = c.cfg.evaluation.every
    if not every:
        return {}
    from megatron_calibclip.trainer.evaluation import evaluate

    if before:
        return evaluate(c, updates=step) if step % every == 0 else {}
    return evaluate(c, updates=step + 1, prefix="eval_final")


def run_dir_for(cfg: TrainConfig) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def resolved_settings(cfg: TrainConfig, c: Components) -> dict[str, str]:
    """The machine-dependent choices of this run (config.yaml keeps `auto`) and the code it
    runs: a run resumed on another machine or commit may differ, and resolved.yaml says what
    each start got."""
    from megatron_calibclip.fp8.backend import run_backend
    from megatron_calibclip.trainer.provenance import code_version

    from megatron_calibclip.fp8.gemm import gemm_path_and_why

    path, why = gemm_path_and_why()
    out = {"device": str(c.device), "params_dtype": cfg.model.resolved_params_dtype(),
           "gemm_path": f"{path} ({why})",
           "layer_spec": getattr(c.policy, "calibclip_backend", "unknown")}  # te | emulated
    for section, recipe in cfg.fp8_recipes_in_use():
        out[f"{section}.backend"] = run_backend(recipe.backend, recipe)[0]
    out.update(code_version())
    return out


def _guard_run_dir(run_dir: Path, cfg: TrainConfig, checkpointer: Optional[Checkpointer],
                   rank0: bool) -> None:
    """Collective: refuse (RunDirError on every rank) a run directory holding other results."""
    message = [None]
    if rank0:
        try:
            check_run_dir(run_dir, cfg, has_checkpoint=None if checkpointer is None
                          else _has_checkpoint(checkpointer))
            run_dir.mkdir(parents=True, exist_ok=True)
        except RunDirError as err:
            message = [str(err)]
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise RunDirError(message[0])


def train(cfg: TrainConfig, *, checkpointer: Optional[Checkpointer] = None,
          init_distributed: bool = True) -> dict[str, Any]:
    """Run `cfg.run.steps` RL steps; returns {'run_dir', 'records'} (records on every rank)."""
    if cfg.run.gemm_path == "auto":  # $CALIBCLIP_GEMM, else the hardware's choice
        return _train(cfg, checkpointer, init_distributed)
    from megatron_calibclip.fp8.gemm import using_gemm_path

    with using_gemm_path(cfg.run.gemm_path):  # restored afterwards (in-process callers)
        return _train(cfg, checkpointer, init_distributed)


def _train(cfg: TrainConfig, checkpointer: Optional[Checkpointer],
           init_distributed: bool) -> dict[str, Any]:
    if init_distributed:
        initialize_distributed(cfg.parallel.layout(), seed=cfg.run.seed)
    rank0 = dist.get_rank() == 0
    run_dir = run_dir_for(cfg)
    _guard_run_dir(run_dir, cfg, checkpointer, rank0)
    from megatron_calibclip.checkpoint import EXIT_PREEMPTED, PreemptionHandler

    # Installed before the start-up: building, loading and warming up a large model takes
    # minutes, and a SIGUSR1/SIGTERM then must still end in "save what is new, exit 75"
    # (requeue), not in the signal's default action (the job would end as failed).
    with PreemptionHandler() as preempt:
        c = build_components(cfg, run_dir)
        if rank0:  # only a configuration that built is recorded
            (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            resolved = resolved_settings(cfg, c)  # what `auto` meant on this machine
            (run_dir / "resolved.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
            print("resolved: " + ", ".join(f"{k} {v}" for k, v in resolved.items()), flush=True)
            if c.skips.total:
                print(f"data: {c.skips.summary()}", flush=True)
        if checkpointer is None and cfg.run.checkpoint:
            from megatron_calibclip.checkpoint import TrainerCheckpointer

            checkpointer = TrainerCheckpointer(
                run_dir / "checkpoints", keep_last=cfg.run.keep_checkpoints,
                optimizer_format=cfg.optimizer.checkpoint_format)
        start_step = 0
        warmed_up = cfg.warmup.steps > 0 and not _has_checkpoint(checkpointer)
        if warmed_up:  # a resumed run has had it
            _warmup(c, cfg, rank0)
            # the reference (KL anchor) is the policy RL starts from: the warmed-up one
            copy_weights(c.policy, c.reference)
        if checkpointer is not None:
            last = checkpointer.load_latest(c)
            start_step = 0 if last is None else last + 1
        if preempt.should_stop():  # collective: signalled during the start-up
            if checkpointer is not None and warmed_up:
                checkpointer.save(start_step - 1, c)  # keep the warm-up: 0 RL steps done
            if rank0:
                print(f"preempted during start-up (before step {start_step}); exiting with "
                      f"{EXIT_PREEMPTED} (requeue)", flush=True)
            raise SystemExit(EXIT_PREEMPTED)
        if start_step > 0 and start_step >= cfg.run.steps:
            if rank0:
                print(f"{run_dir}: {start_step} steps already done (run.steps = {cfg.run.steps}); "
                      f"nothing to run: raise run.steps to continue", flush=True)
            return {"run_dir": run_dir, "records": []}
        t0 = time.perf_counter()
        records = _run_steps(c, run_dir, start_step, checkpointer, preempt, rank0)
    if rank0 and records:
        _report_end(cfg, c, run_dir, len(records), time.perf_counter() - t0,
                    checkpoints=checkpointer is not None)
    return {"run_dir": run_dir, "records": records}


def _run_steps(c: Components, run_dir: Path, start_step: int, checkpointer: Optional[Checkpointer],
               preempt, rank0: bool) -> list[dict[str, Any]]:
    """Steps start_step .. run.steps - 1: evaluate, train, log metrics and samples, checkpoint."""
    from megatron_calibclip.checkpoint import EXIT_PREEMPTED

    cfg = c.cfg
    logger = MetricsLogger(run_dir, cfg.run.steps - start_step, enabled=rank0,
                           tensorboard=cfg.run.tensorboard, progress=cfg.run.progress,
                           start_step=start_step)
    samples = SampleWriter(run_dir, every=cfg.samples.every, count=cfg.samples.count,
                           group_size=cfg.algorithm.group_size, enabled=rank0, start_step=start_step)
    records = []
    try:
        for step in range(start_step, cfg.run.steps):
            last = step == cfg.run.steps - 1
            t = time.perf_counter()
            before = _evaluation(c, step, before=True)
            write = (lambda data, s=step: samples.write(s, data, c.tokenizer)) if samples.due(step) else None
            metrics = train_step(c, step, on_data=write)
            metrics.update(before)
            metrics.update(_evaluation(c, step, before=False) if last else {})
            metrics["time/step"] = time.perf_counter() - t
            if c.skips.total:
                metrics["data/skipped"] = float(c.skips.total)
            logger.log(step, metrics)
            records.append(metrics)
            every = cfg.run.save_every
            if preempt.should_stop():  # collective: every rank stops after this step
                if checkpointer is not None:
                    checkpointer.save(step, c)
                if rank0:
                    print(f"preempted: saved after step {step}; exiting with "
                          f"{EXIT_PREEMPTED} (requeue)", flush=True)
                raise SystemExit(EXIT_PREEMPTED)
            if checkpointer is not None and (last or (every and (step + 1) % every == 0)):
                checkpointer.save(step, c)
    finally:
        logger.close()
        samples.close()
    return records


def _report_end(cfg: TrainConfig, c: Components, run_dir: Path, steps: int, seconds: float, *,
                checkpoints: bool) -> None:
    """Rank 0, after the last step: the plot, the summary and calibration tables, done.json."""
    all_records = read_metrics(run_dir / "metrics.jsonl")
    if cfg.run.plot:
        png = plot_summary(all_records, run_dir / "summary.png",
                           title=f"{cfg.run.name}: {cfg.algorithm.name}, trainer "
                                 f"{cfg.precision}, clipping {cfg.clipping.mode}")
        print(f"plot: {png}")
    print(summary_table(all_records))
    print(learning_line(all_records))
    if calibration_records(all_records):
        print(calibration_table(all_records))
        print(calibration_line(all_records))
    if c.skips.total:
        print(f"data: {c.skips.summary()}")
    outputs = ["metrics.jsonl"] + (["samples.jsonl"] if cfg.samples.every else []) + [
        "tensorboard/", "summary.png", "config.yaml"] + (["checkpoints/"] if checkpoints else [])
    print(f"{steps} steps in {seconds:.1f}s; outputs in {run_dir}/ ({', '.join(outputs)})")
    (run_dir / "done.json").write_text(json.dumps({"steps": cfg.run.steps}))


def main_train(cfg: TrainConfig) -> int:
    """Entry point of `calibclip train`: train, then tear the process groups down."""
    try:
        train(cfg)
    finally:
        teardown()
    return 0
