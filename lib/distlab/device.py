"""Device and dtype choice, peak FLOP/s (vendor table or measured here), memory readings."""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from distlab.jsonio import strict_json
from distlab.paths import CACHE_DIR
from distlab.provenance import cpuinfo_field, device_description

# Dense (no sparsity) peak FLOP/s from vendor data sheets, matched by substring of the device name.
# Only used when the name matches; anything else is measured with a matmul benchmark.
KNOWN_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},  # SXM; PCIe is lower, measured numbers tell
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
    "A10": {"bf16": 125e12, "fp32": 31.2e12},
    "RTX 4090": {"bf16": 165e12, "fp32": 82.6e12},
    "MI300X": {"bf16": 1307e12, "fp32": 163e12},
    "MI250X": {"bf16": 383e12, "fp32": 47.9e12},
    "MI100": {"bf16": 92.3e12, "fp32": 23.1e12},
}


def backend_for(device: str = "auto") -> str:
    """The process-group backend for ranks on `device`: nccl for GPUs (RCCL answers to the same
    name on ROCm), gloo for CPU ranks. `auto` means a GPU when one is visible."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "nccl" if str(device).startswith("cuda") else "gloo"


@dataclass(frozen=True)
class DeviceChoice:
    device: torch.device
    dtype: torch.dtype  # storage/compute dtype of the model weights
    autocast_dtype: torch.dtype | None  # None: no autocast

    @property
    def kind(self) -> str:
        return self.device.type


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether bf16 matmuls run natively here: every CUDA/ROCm GPU torch supports bf16 on, and CPUs
    with AVX512-BF16 or AMX (elsewhere a CPU emulates bf16, slower than fp32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo; empty where there is none (then no native bf16 is assumed)."""
    return set((cpuinfo_field("flags") or "").split())


# dtype names that resolve to one of the table's entries in choose_device, depending on the hardware
DTYPE_ALIASES = ("auto", "auto-bf16")


class DeviceError(ValueError):
    """A device the config names that this machine does not have (one line, exit 2: the input is wrong here)."""


def choose_device(device: str = "auto", dtype: str = "auto", local_rank: int = 0) -> DeviceChoice:
    """`auto`: CUDA/ROCm GPU when present (bf16 autocast, fp32 master weights), else CPU in fp32.
    `auto-bf16`: bf16 autocast wherever bf16 matmuls are native (native_bf16), else fp32.

    On CPU `auto` keeps fp32: the distributed chapters' loss-equality checks need fp32's
    determinism, and on most CPUs bf16 is emulated. Chapter 01 trains with `auto-bf16`: on a CPU
    with AVX512-BF16 a bf16 matmul runs several times faster than fp32 (its recipe ablation measures it)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(f"cuda:{local_rank}" if device == "cuda" else device)
    if dev.type == "cuda" and not torch.cuda.is_available():  # else torch's AssertionError, deep in a .to()
        raise DeviceError(f"device={device}: no CUDA (or ROCm) GPU is available to this torch "
                          f"({torch.__version__}); use device=auto or device=cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise DeviceError(f"device={dev}: this machine has {torch.cuda.device_count()} GPU(s)")
    if dtype == "auto":
        dtype = "bf16-autocast" if dev.type == "cuda" else "fp32"
    elif dtype == "auto-bf16":
        dtype = "bf16-autocast" if native_bf16(dev) else "fp32"
    table = {
        "fp32": (torch.float32, None),
        "bf16-autocast": (torch.float32, torch.bfloat16),
        "bf16": (torch.bfloat16, None),
        "fp16-autocast": (torch.float32, torch.float16),
    }
    if dtype not in table:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPE_ALIASES)}, {', '.join(table)}")
    store, auto = table[dtype]
    return DeviceChoice(dev, store, auto)


def device_name(device: torch.device | str = "cpu") -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)

    return device_description()


def _dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def measure_matmul_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         n: int | None = None, seconds: float = 1.0) -> float:
    """Achieved FLOP/s of an n x n matmul, repeated for about `seconds`, best of three rounds.

    Its random operands come from a generator of its own: the trainer measures its peak between seeding a
    run and its first step, and drawing from the global generator there would change the run's dropout."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.matmul(a, b)
    sync()
    t0 = time.perf_counter()
    torch.matmul(a, b)
    sync()
    one = max(time.perf_counter() - t0, 1e-6)
    reps = max(1, int(seconds / 3 / one))
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0))
    return best


def peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               refresh: bool = False) -> tuple[float, str]:
    """(FLOP/s, source) used as the MFU denominator.

    A known GPU takes its data-sheet peak; anything else (every CPU) is measured once with a
    matmul at the current thread count and cached under build/cache, keyed by device, dtype and
    threads, so later runs and other chapters use the same number."""
    device = torch.device(device)
    name = device_name(device)
    key = _dtype_key(dtype)
    if device.type == "cuda":
        for pattern, peaks in KNOWN_PEAKS.items():
            if pattern in name and key in peaks:
                return peaks[key], f"data sheet ({pattern} {key})"
    threads = torch.get_num_threads()
    cache = CACHE_DIR / "peak_flops.json"
    ident = f"{name}|{key}|threads={threads}"
    table = {}
    if cache.exists():
        try:
            table = json.loads(cache.read_text())
        except json.JSONDecodeError:
            table = {}
    if table.get(ident) is None or refresh:  # null: the measurement was not finite (written strict): measure again
        table[ident] = measure_matmul_flops(device, dtype)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(strict_json(table, indent=1, sort_keys=True))
        tmp.replace(cache)  # atomic: several ranks may measure at once
    return table[ident], f"measured matmul ({key}, {threads} thread{'s' * (threads != 1)})"


def autocast(choice: DeviceChoice):
    """Mixed-precision context for forward passes (a no-op when the choice has no autocast dtype)."""
    return torch.autocast(choice.device.type, dtype=choice.autocast_dtype, enabled=choice.autocast_dtype is not None)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the CUDA allocator's counter, or on Linux the process's peak RSS (writing
    5 to /proc/self/clear_refs resets VmHWM), so each run of a sweep reports its own peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak then counts from the process start


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process since the last reset: the CUDA allocator's peak on GPU, peak
    RSS on CPU (VmHWM; ru_maxrss, which cannot be reset, where /proc is missing)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
