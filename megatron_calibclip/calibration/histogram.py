"""A fixed-grid histogram of log-ratios, merged across ranks with one SUM all-reduce.

Why a histogram: calibration needs quantiles and mass thresholds of ratios pooled over every
data-parallel (and context-parallel) rank. Gathering the tokens costs O(tokens) traffic; if
every rank bins log r on the same fixed grid, the merge is one all-reduce of O(bins) numbers
and every query is read from cumulative sums.

Slots are right-closed so that "x <= grid point" is exactly a prefix of slots:

    slot 0            (-inf, lo]            underflow, kept (never dropped)
    slot i, 1..bins   (e[i-1], e[i]]        e[i] = lo + i * (hi - lo) / bins, e[bins] = hi
    slot bins + 1     (hi, +inf)            overflow, kept

A value's slot is decided by float64 comparisons with the edge values (a ceil() guess that is
then corrected), so slot membership agrees exactly with `e[i-1] < x <= e[i]`.

Queries (see README.md for the exact definitions):
  * threshold(channel, target, interpolate=False): the smallest grid point g (edges, plus +inf)
    with C(g) >= target - rtol * total, where C(g) = weight of samples with x <= g. This is
    the exact answer rounded *up* to the grid, so it is within one slot of it.
  * threshold(..., interpolate=True): the same slot, with linear interpolation inside it;
    answers below lo / above hi are clipped to lo / hi.
  * zoom(slot or (first, last)): a second-pass histogram of the bracketing slot(s) on a finer
    grid (one more all-reduce) that carries the global sums below/above them, so its answers
    are global answers.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_calibclip.parallel.devices import HOST

Weights = Mapping[str, "torch.Tensor | None"]


def distributed_active() -> bool:
    """True when a torch.distributed process group exists (else local data is global data)."""
    return dist.is_available() and dist.is_initialized()


class DistributedHistogram:
    """Weighted histograms ("channels") of log r on one shared grid, plus exact scalar sums.

    Channels are named weightings of the same samples (e.g. a token count and an |A| r mass);
    scalars are extra sums (e.g. exact counts at a fixed threshold) that ride along in the
    same all-reduce, so one merge answers everything a calibration needs.
    """

    def __init__(
        self,
        lo: float = -4.0,
        hi: float = 4.0,
        bins: int = 16384,
        channels: Sequence[str] = ("count",),
        scalars: Sequence[str] = (),
        *,
        keep_samples: bool = False,
        rtol: float = 1e-9,
        device: torch.device | str | None = None,
    ) -> None:
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"histogram range must be finite with lo < hi, got [{lo}, {hi}]")
        if int(bins) != bins or bins < 1:
            raise ValueError(f"bins must be a positive integer, got {bins!r}")
        channels, scalars = tuple(channels), tuple(scalars)
        if not channels or len(set(channels)) != len(channels):
            raise ValueError(f"channels must be non-empty and unique, got {channels}")
        if len(set(scalars)) != len(scalars):
            raise ValueError(f"scalars must be unique, got {scalars}")
        if not 0.0 <= rtol < 1e-3:
            raise ValueError(f"rtol must be in [0, 1e-3), got {rtol}")
        self.lo, self.hi, self.bins = float(lo), float(hi), int(bins)
        self.width = (self.hi - self.lo) / self.bins
        self.channels, self.scalar_names = channels, scalars
        self.keep_samples, self.rtol = keep_samples, float(rtol)
        self.device = torch.device(device) if device is not None else HOST
        edges = self.lo + torch.arange(self.bins + 1, dtype=torch.float64, device=HOST) * self.width
        edges[0], edges[-1] = self.lo, self.hi
        self.edges = edges  # e[0..bins], on the CPU (queries run on the CPU)
        inf = torch.tensor([math.inf], dtype=torch.float64, device=HOST)
        # slot s is (ext[s], ext[s + 1]]
        self._ext_cpu = torch.cat([-inf, edges, inf])
        self._ext = self._ext_cpu.to(self.device)
        self._data = torch.zeros(len(channels), self.bins + 2, dtype=torch.float64, device=self.device)
        self._scalars = torch.zeros(len(scalars), dtype=torch.float64, device=self.device)
        self._samples: list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]] = []
        self._base: tuple[list[float], list[float]] | None = None  # zoom: global sums below/above
        self._bounded = False  # zoom: answers are clamped into [lo, hi]
        self._cum: dict[str, torch.Tensor] = {}
        self.reduced = False

    # ------------------------------------------------------------------ filling
    def slots(self, logr: torch.Tensor) -> torch.Tensor:
        """Slot index (0..bins+1) of each finite value, consistent with float64 edge comparisons."""
        x = logr.detach().to(device=self.device, dtype=torch.float64).reshape(-1)
        guess = torch.ceil((x - self.lo) / self.width).clamp_(0, self.bins + 1).long()
        guess -= (x <= self._ext[guess]).long()  # rounding put it one slot too high
        guess += (x > self._ext[guess + 1]).long()  # ... or one slot too low
        return guess

    def add(self, logr: torch.Tensor, weights: Weights | None = None) -> None:
        """Bin local samples; `weights` maps channel -> per-sample weight (None = 1 per sample).

        Without `weights` every channel counts samples. Values must be finite: the caller decides
        what a masked or non-finite token means (calibration filters and reports them).
        """
        if self.reduced:
            raise RuntimeError("add() after all_reduce(): the histogram already holds global sums")
        x = logr.detach().to(device=self.device, dtype=torch.float64).reshape(-1)
        if not bool(torch.isfinite(x).all()):
            raise ValueError("DistributedHistogram.add: log-ratios must be finite (filter them first)")
        if weights is None:
            weights = {c: None for c in self.channels}
        unknown = set(weights) - set(self.channels)
        if unknown:
            raise KeyError(f"unknown channel(s) {sorted(unknown)}; channels are {list(self.channels)}")
        s = self.slots(x)
        kept: dict[str, torch.Tensor | None] = {}
        for name, w in weights.items():
            row = self.channels.index(name)
            if w is None:
                self._data[row] += torch.bincount(s, minlength=self.bins + 2).to(torch.float64)
                kept[name] = None
            else:
                w = w.detach().to(device=self.device, dtype=torch.float64).reshape(-1)
                if w.numel() != x.numel():
                    raise ValueError(f"channel {name!r}: {w.numel()} weights for {x.numel()} values")
                self._data[row] += torch.bincount(s, weights=w, minlength=self.bins + 2)
                kept[name] = w
        if self.keep_samples and x.numel():
            self._samples.append((s, x, kept))
        self._cum.clear()

    def add_scalar(self, name: str, value: float | torch.Tensor) -> None:
        """Add to a named scalar sum (merged by the same all-reduce as the histogram)."""
        if self.reduced:
            raise RuntimeError("add_scalar() after all_reduce()")
        self._scalars[self.scalar_names.index(name)] += value

    # ------------------------------------------------------------------ merging
    @property
    def payload_bytes(self) -> int:
        """Bytes this histogram contributes to an all-reduce: O(channels * bins), never O(tokens)."""
        return (self._data.numel() + self._scalars.numel()) * self._data.element_size()

    def all_reduce(self, group: dist.ProcessGroup | None = None) -> int:
        """Sum over the ranks of `group` (one collective); returns the payload bytes (0 if local)."""
        return all_reduce_histograms([self], group)

    def _finish_reduce(self) -> None:
        if self._base is not None:
            below, above = self._base
            self._data[:, 0] += torch.tensor(below, dtype=torch.float64, device=self.device)
            self._data[:, -1] += torch.tensor(above, dtype=torch.float64, device=self.device)
        self.reduced = True
        self._cum.clear()

    def merged_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot sums per channel, scalar sums) after the merge, as CPU float64 copies: what a
        later calibration pools (identical on every rank, so rank 0's copy is everyone's)."""
        if not self.reduced:
            raise RuntimeError("merged_sums() needs the merged histogram: call all_reduce() first")
        return self._data.detach().cpu().clone(), self._scalars.detach().cpu().clone()

    def add_merged(self, data: torch.Tensor, scalars: torch.Tensor) -> None:
        """Add another merged histogram of the same layout (from `merged_sums`): pooling.
        The kept samples are not extended, so a pooled histogram answers at bin resolution."""
        if not self.reduced:
            raise RuntimeError("add_merged() pools merged histograms: call all_reduce() first")
        if tuple(data.shape) != tuple(self._data.shape) or tuple(scalars.shape) != tuple(self._scalars.shape):
            raise ValueError(f"cannot pool a histogram of shape {tuple(data.shape)} + {tuple(scalars.shape)} "
                             f"into {tuple(self._data.shape)} + {tuple(self._scalars.shape)}")
        self._data += data.to(device=self.device, dtype=torch.float64)
        self._scalars += scalars.to(device=self.device, dtype=torch.float64)
        self._cum.clear()

    # ------------------------------------------------------------------ queries
    def scalar(self, name: str) -> float:
        return float(self._scalars[self.scalar_names.index(name)])

    def counts(self, channel: str) -> torch.Tensor:
        """Per-slot sums of a channel (CPU, float64, bins + 2 slots incl. under/overflow)."""
        return self._data[self.channels.index(channel)].cpu()

    def _cumsum(self, channel: str) -> torch.Tensor:
        if channel not in self._cum:
            self._cum[channel] = torch.cumsum(self.counts(channel), 0)
        return self._cum[channel]

    def total(self, channel: str) -> float:
        return float(self._cumsum(channel)[-1])

    def at_most(self, channel: str, slot: int) -> float:
        """Weight of samples in slots 0..slot, i.e. with x <= right_edge(slot)."""
        cum = self._cumsum(channel)
        return float(cum[min(slot, self.bins + 1)])

    def above(self, channel: str, slot: int) -> float:
        """Weight of samples in slots > slot, i.e. with x > right_edge(slot); summed directly."""
        return float(self.counts(channel)[slot + 1 :].sum())

    def locate(self, channel: str, target: float) -> int:
        """First slot s with C(s) >= target - rtol * total; bins + 2 if the target is never reached.

        The relative tolerance makes sums that are mathematically equal but added in another
        order (another rank split, a reference computation) reach the target identically.
        """
        if math.isnan(target):
            raise ValueError("target is NaN")
        cum = self._cumsum(channel)
        need = target - self.rtol * float(cum[-1])
        return int(torch.searchsorted(cum, torch.tensor([need], dtype=torch.float64,
                                                        device=cum.device)).item())

    def locate_value(self, x: float) -> int:
        """The slot holding the value x (the same rule as `slots`, for one Python float)."""
        return int(self.slots(torch.tensor([x], dtype=torch.float64, device=self.device))[0])

    def right_edge(self, slot: int) -> float:
        """Smallest grid point g with every sample of slots <= slot at most g (+inf past hi)."""
        if slot >= self.bins + 1:
            return self.hi if self._bounded else math.inf
        return float(self._ext_cpu[slot + 1])

    def threshold(self, channel: str, target: float, *, interpolate: bool = True) -> float:
        """Smallest x (log r) at which the cumulative weight of `channel` reaches `target`.

        interpolate=False: the smallest grid point that reaches it (exact answer rounded up to
        the grid; -inf targets give lo, unreachable ones +inf). interpolate=True: linear inside
        the bracketing slot, clipped to [lo, hi].
        """
        slot = self.locate(channel, target)
        if not interpolate:
            return self.right_edge(slot)
        if slot == 0:
            return self.lo
        if slot >= self.bins + 1:
            return self.hi
        cum = self._cumsum(channel)
        inside = float(cum[slot] - cum[slot - 1])
        frac = (target - float(cum[slot - 1])) / inside if inside > 0 else 1.0
        frac = min(max(frac, 0.0), 1.0)
        left, right = float(self._ext_cpu[slot]), float(self._ext_cpu[slot + 1])
        return left + frac * (right - left)

    def quantile(self, channel: str, q: float, *, interpolate: bool = True) -> float:
        """q-quantile of log r: smallest x with C(x) >= q * total (see threshold)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q}")
        return self.threshold(channel, q * self.total(channel), interpolate=interpolate)

    # ------------------------------------------------------------------ refinement
    def zoom(self, slots: int | tuple[int, int], bins: int = 4096,
             channels: Iterable[str] | None = None) -> DistributedHistogram:
        """Local histogram of interior slot(s) `first..last`, `bins` times finer per slot.

        Only the kept samples of those slots are re-binned; the global sums below and above
        them are added after the merge (all_reduce), so the zoom answers global queries whose
        answer lies in those slots (answers outside are clamped to the zoomed range).
        """
        first, last = (slots, slots) if isinstance(slots, int) else slots
        if not self.reduced:
            raise RuntimeError("zoom() needs the merged histogram: call all_reduce() first")
        if not self.keep_samples:
            raise RuntimeError("zoom() needs keep_samples=True")
        if not 1 <= first <= last <= self.bins:
            raise ValueError(f"only interior slots 1..{self.bins} can be zoomed, got {first}..{last}")
        names = tuple(dict.fromkeys(channels if channels is not None else self.channels))
        child = DistributedHistogram(
            float(self.edges[first - 1]), float(self.edges[last]), bins * (last - first + 1), names,
            rtol=self.rtol, device=self.device,
        )
        child._bounded = True
        child._base = (
            [self.at_most(c, first - 1) for c in names],
            [self.above(c, last) for c in names],
        )
        for s, x, kept in self._samples:
            sel = (s >= first) & (s <= last)
            if bool(sel.any()):
                child.add(x[sel], {c: None if kept[c] is None else kept[c][sel] for c in names if c in kept})
        return child


def all_reduce_histograms(hists: Sequence[DistributedHistogram], group: dist.ProcessGroup | None = None) -> int:
    """Merge several histograms with ONE all-reduce (SUM); returns the payload bytes (0 if local).

    Every rank of `group` must call this with histograms of identical layouts, in the same order.
    """
    if any(h.reduced for h in hists):
        raise RuntimeError("histogram already reduced")
    if not hists:
        return 0
    flat = torch.cat([t for h in hists for t in (h._data.reshape(-1), h._scalars)])
    nbytes = 0
    if distributed_active():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        nbytes = flat.numel() * flat.element_size()
    offset = 0
    for h in hists:
        n = h._data.numel()
        h._data.copy_(flat[offset : offset + n].view_as(h._data))
        offset += n
        m = h._scalars.numel()
        h._scalars.copy_(flat[offset : offset + m])
        offset += m
        h._finish_reduce()
    return nbytes
