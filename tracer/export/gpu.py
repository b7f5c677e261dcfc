"""GPU telemetry through NVML (pynvml from nvidia-ml-py), sampled on a background thread.

With no NVIDIA driver (as on CPU machines) the sampler logs one line, sets `splitscope_gpu_telemetry_up`
to 0 and stops: it never raises into the caller. With a driver, every `interval_s` it sets
`splitscope_gpu_utilization_ratio{gpu}` (NVML's busy share over its last sample period, 0..1) and
`splitscope_gpu_memory_used_bytes{gpu}`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tracer.metrics import Catalogue

log = logging.getLogger(__name__)


def _load_nvml() -> Any:
    import pynvml

    return pynvml


class GpuSampler:
    """Background NVML sampler. `start()` returns at once; `stop()` joins the thread (bounded wait)."""

    def __init__(self, catalogue: Catalogue, interval_s: float = 1.0, nvml: Any | None = None) -> None:
        self.catalogue = catalogue
        self.interval_s = interval_s
        self._nvml = nvml
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = False
        self.reason = ""

    def start(self) -> GpuSampler:
        try:
            nvml = self._nvml or _load_nvml()
            nvml.nvmlInit()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        except Exception as exc:  # no library, no driver, no device: all mean "no GPU telemetry"
            self.reason = f"{type(exc).__name__}: {exc}".strip()
            log.info("gpu telemetry unavailable (%s)", self.reason)
            self.catalogue.gpu_telemetry_up.set(0)
            return self
        self.available = bool(handles)
        self.catalogue.gpu_telemetry_up.set(1 if handles else 0)
        if handles:
            self._thread = threading.Thread(target=self._run, args=(nvml, handles), name="splitscope-gpu", daemon=True)
            self._thread.start()
        return self

    def _run(self, nvml: Any, handles: list[Any]) -> None:
        utilization = [self.catalogue.gpu_utilization.labels(gpu=str(i)) for i in range(len(handles))]
        memory = [self.catalogue.gpu_memory_used.labels(gpu=str(i)) for i in range(len(handles))]
        while not self._stop.is_set():
            try:
                for i, handle in enumerate(handles):
                    utilization[i].set(nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
                    memory[i].set(nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except Exception as exc:  # a lost device must not kill the process it watches
                log.warning("gpu telemetry stopped: %s", exc)
                self.catalogue.gpu_telemetry_up.set(0)
                return
            self._stop.wait(self.interval_s)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
