"""Calibrated Clipping: pooled quantile estimation of FP8 vs shadow ratios -> clip bounds [L, H].

Floor 2: knows torch.distributed and tensors, nothing about models or losses. See README.md
in this folder for the exact definitions (quantiles, masks, out-of-range tokens, guards).
"""
from megatron_calibclip.calibration.bounds import CalibrationAccumulator, compute_calibrated_bounds
from megatron_calibclip.calibration.clipper import CalibratedClipper
from megatron_calibclip.calibration.config import CalibrationConfig
from megatron_calibclip.calibration.histogram import DistributedHistogram, all_reduce_histograms
from megatron_calibclip.calibration.result import CalibrationResult

__all__ = [
    "CalibratedClipper",
    "CalibrationAccumulator",
    "CalibrationConfig",
    "CalibrationResult",
    "DistributedHistogram",
    "all_reduce_histograms",
    "compute_calibrated_bounds",
]
