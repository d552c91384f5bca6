"""GPU statistics for heartbeats, from NVML; a clean "no GPU" where there is none.

The NVML calls sit behind ``GpuProbe`` so tests can stand in a fake where no
GPU exists; everything else reads plain dicts.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class GpuProbe:
    """Reads one GPU's stats through NVML; ``available`` is False where NVML cannot start."""

    def __init__(self, index: int | None):
        self.index, self.available, self.reason, self._handle = index, False, "no GPU", None
        if index is None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.available = True
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError, ...
            self.reason = f"no GPU ({type(exc).__name__})"

    def stats(self) -> dict:
        if not self.available:
            return {"gpu": None, "note": self.reason}
        nv, h = self._nvml, self._handle
        out: dict = {"gpu": self.index}
        for name, read in (
            ("name", lambda: nv.nvmlDeviceGetName(h)),
            ("util_pct", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
            ("mem_used_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).used),
            ("mem_total_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).total),
            ("temp_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
        ):
            try:
                value = read()
                out[name] = value.decode() if isinstance(value, bytes) else value
            except Exception:  # a field this GPU or driver does not report
                out[name] = None
        return out
