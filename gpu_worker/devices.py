"""GPU statistics for heartbeats, from NVML; a clean "no GPU" where there is none.

The NVML calls sit behind ``GpuProbe`` so tests can stand in a fake where no
GPU exists; everything else reads plain dicts.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def nvml_handle(pynvml, index: int, uuid: str | None):
    """The NVML handle of CUDA device ``index`` of this process.

    CUDA numbers the devices it sees (after CUDA_VISIBLE_DEVICES); NVML numbers
    all of the host's. The UUID names the same chip in both; without it, map
    through CUDA_VISIBLE_DEVICES when that is a list of indices.
    """
    if uuid:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    parts = [p.strip() for p in visible.split(",") if p.strip()]
    if parts and all(p.isdigit() for p in parts) and index < len(parts):
        index = int(parts[index])
    return pynvml.nvmlDeviceGetHandleByIndex(index)


class GpuProbe:
    """Reads one GPU's stats through NVML; ``available`` is False where NVML cannot start."""

    def __init__(self, index: int | None, uuid: str | None = None):
        self.index, self.available, self.reason, self._handle = index, False, "no GPU", None
        if index is None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = nvml_handle(pynvml, index, uuid)
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
