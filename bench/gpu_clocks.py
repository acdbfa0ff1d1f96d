"""The SM clock and board power of this process's GPU while benchmark variants run (NVML through
ctypes: the driver's ``libnvidia-ml.so.1``, no Python package needed).

Session 28 found the timed training steps of bench/model.py running at the GPUs' power limit with
the SM clock 15-25% below its maximum, while the profiler's two steps ran at full clock
(docs/PERF_NOTES.model.md). Two variants that draw different power then run at different clocks,
and their time ratio says so only if the clocks are reported beside it. ``Sampler`` reads both every
``interval`` seconds on a thread; the caller records which variant ran when (``span``), and
``summary`` gives each variant's median clock and power over the samples inside its spans.

    sampler = Sampler.for_current_device()   # None without NVML or a CUDA device
    sampler.start(); ...; sampler.span("compile", t0, t1); ...; sampler.stop()
    summary(sampler.samples, sampler.spans)  # {"compile": (MHz, W, samples), ...}
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time

__all__ = ["Sampler", "summary"]

_NVML_CLOCK_SM = 1
_NVML_SUCCESS = 0


def summary(samples, spans) -> dict:
    """``{name: (median SM MHz, median W, number of samples)}`` over the ``(time, MHz, W)`` samples
    that fall inside the ``(name, start, end)`` spans of each name (names without a sample are left
    out)."""
    picked: dict = {}
    for name, start, end in spans:
        picked.setdefault(name, []).extend((mhz, watts) for t, mhz, watts in samples if start <= t <= end)
    return {name: (statistics.median(m for m, _ in got), statistics.median(w for _, w in got), len(got))
            for name, got in picked.items() if got}


class Sampler:
    """NVML readings of one GPU on a background thread (see the module docstring)."""

    def __init__(self, lib, handle, interval: float):
        self._lib, self._handle, self.interval = lib, handle, interval
        self.samples: list[tuple[float, float, float]] = []  # (time.perf_counter(), SM MHz, W)
        self.spans: list[tuple[str, float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_current_device(cls, interval: float = 0.01) -> "Sampler | None":
        """A sampler of the current CUDA device, or None where NVML or the device cannot be opened
        (no driver library, a device NVML does not list)."""
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != _NVML_SUCCESS:
                return None
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            handle = ctypes.c_void_p()
            found = False
            uuid = str(getattr(props, "uuid", ""))
            for name in (uuid, f"GPU-{uuid}") if uuid else ():
                if lib.nvmlDeviceGetHandleByUUID(name.encode(), ctypes.byref(handle)) == _NVML_SUCCESS:
                    found = True
                    break
            if not found:
                bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
                found = lib.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(handle)) == _NVML_SUCCESS
            sampler = cls(lib, handle, interval) if found else None
            if sampler is not None and sampler.read() is None:
                return None
            return sampler
        except Exception:  # noqa: BLE001 - diagnostics: a benchmark never fails for want of its clocks
            return None

    def read(self) -> tuple[float, float] | None:
        """``(SM MHz, W)`` now, or None if NVML refuses either reading."""
        clock, milliwatts = ctypes.c_uint(), ctypes.c_uint()
        if self._lib.nvmlDeviceGetClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(clock)) != _NVML_SUCCESS:
            return None
        if self._lib.nvmlDeviceGetPowerUsage(self._handle, ctypes.byref(milliwatts)) != _NVML_SUCCESS:
            return None
        return float(clock.value), milliwatts.value / 1000.0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                reading = self.read()
            except Exception:  # noqa: BLE001 - diagnostics: stop sampling, keep what was read
                return
            if reading is not None:
                self.samples.append((time.perf_counter(), *reading))

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpu-clocks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def span(self, name: str, start: float, end: float) -> None:
        """Variant ``name`` kept the GPU busy from ``start`` to ``end`` (``time.perf_counter()``)."""
        self.spans.append((name, start, end))
