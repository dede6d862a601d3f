"""The GPU's SM clock, board power and clock-event reasons over time, sampled by `nvidia-smi -lms` in the
background, so a timing can be read next to the clock it ran at.

Why: on an H100 the same FA3 kernel measured up to 10% apart between rounds of one run, and
FA3 soft-cap runs near the board's power limit (Nsight Compute clocked stock FA3 down to 1.69 GHz).
A contender's median alone cannot say whether it was faster or only cooler.
"""
from __future__ import annotations

import datetime
import shutil
import statistics
import subprocess
import threading

_FIELDS = ("timestamp", "clocks.sm", "power.draw", "temperature.gpu")
_REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer drivers, older drivers


class ClockTrace:
    """with ClockTrace() as trace: ...; trace.during(t0, t1) -> {"mhz", "watts", "celsius", "reasons", "n"}
    for wall-clock seconds t0..t1 (time.time()). `gpus`: nvidia-smi ids to try in turn, the first it answers for
    is traced (`self.gpu`); nvidia-smi numbers boards in PCI order, CUDA need not, so pass the device's UUID first
    (cuda_device_ids). Without nvidia-smi, or if it answers for none, it records nothing and says so (`error`)."""

    def __init__(self, interval_ms: int = 50, gpus: tuple[str, ...] = ("0",)):
        self.interval_ms, self.gpus, self.samples, self.error, self.gpu = interval_ms, gpus, [], None, None
        self._proc = self._reader = None

    def __enter__(self):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            self.error = "nvidia-smi not found"
            return self
        refusals = []
        for gpu, reasons in ((g, r) for g in self.gpus for r in _REASONS):
            query = ",".join((*_FIELDS, reasons))
            try:
                probe = subprocess.run([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", gpu],
                                       capture_output=True, text=True, timeout=20)
            except subprocess.TimeoutExpired:
                refusals.append(f"-i {gpu}: no answer in 20 s")
                continue
            if probe.returncode == 0:
                self.gpu = gpu
                break
            refusals.append(f"-i {gpu}: {probe.stdout.strip() or probe.stderr.strip()}")
        else:
            self.error = "nvidia-smi refused the query: " + "; ".join(refusals)
            return self
        self._proc = subprocess.Popen([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", gpu,
                                       f"-lms={self.interval_ms}"], stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.samples.append((stamp, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
            except (ValueError, IndexError):
                continue  # a malformed or "[N/A]" line

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
            self._reader.join(timeout=5)

    def during(self, t0: float, t1: float) -> dict:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return {"n": 0}
        return {"n": len(inside), "mhz": statistics.mean(s[1] for s in inside),
                "watts": statistics.mean(s[2] for s in inside), "celsius": max(s[3] for s in inside),
                "reasons": sorted({s[4] for s in inside})}


def cuda_device_ids(index: int = 0) -> tuple[str, ...]:
    """nvidia-smi ids for CUDA device `index`, most specific first: its UUID, then its CUDA index."""
    import torch
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    ids = (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}",) if uuid else ()
    return (*ids, str(index))
