"""Know your machine before going distributed: what is installed, what hardware is there, and
whether every rank (on this node or on others) sees the same software.

`environment_report()` describes this process's machine. `fingerprint()` is the part of it that
must agree across ranks; distlab.workers.launcher.run_fingerprint launches it under torchrun so every rank reports and
rank 0 flags the fields that differ.
"""

from __future__ import annotations

import platform
import shutil
import socket
import subprocess
from typing import Any, Mapping, Sequence

import pandas as pd
import psutil
import torch
import torch.distributed as dist

from distlab.device import backend_for
from distlab.machine import usable_cores
from distlab.provenance import cpu_model, package_versions

DIST_BACKENDS = ("nccl", "gloo", "mpi")

# Fields of fingerprint() that must be equal on every rank before a multi-node job is worth
# starting. The other fields (hostname, device names, CPU) identify a node and may differ: a
# heterogeneous LAN cluster is allowed, a mixed software stack is not.
INFO_FIELDS = ("hostname", "devices", "device_count", "cpu_model", "torch_num_threads")

FAKE_RANK1_ENV = "DISTLAB_FINGERPRINT_FAKE_RANK1"  # test knob, see workers/fingerprint.py

# The backend the tutorial's ranks use on a device (notebook 00 prints it): distlab.device decides.


# ---------------------------------------------------------------- versions and hardware

def accelerator_runtime() -> tuple[str, str]:
    """('CUDA', version) or ('ROCm', version) that this torch was built for, or ('none', '')."""
    if getattr(torch.version, "hip", None):
        return "ROCm", str(torch.version.hip)
    if torch.version.cuda:
        return "CUDA", str(torch.version.cuda)
    return "none", ""


def nccl_version() -> str:
    """The NCCL (RCCL on ROCm) bundled with torch: it must match across nodes for nccl jobs."""
    if not torch.cuda.is_available():
        return "n/a"
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # torch built without NCCL
        return "n/a"


def gpu_driver_version() -> str:
    """The kernel driver, read from the vendor tool (torch has no public API for it)."""
    if shutil.which("nvidia-smi"):
        lines = _tool_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).split()
        return lines[0] if lines else "unknown"
    if shutil.which("rocm-smi"):
        for line in _tool_output(["rocm-smi", "--showdriverversion"]).splitlines():
            if "driver version" in line.lower() and ":" in line:
                return line.split(":", 1)[1].strip()
        return "unknown"
    return "n/a"


def _tool_output(cmd: list[str], timeout_s: float = 10) -> str:
    """stdout of a vendor tool, or '' when it hangs or fails (a wedged driver must not hang us)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def accelerators() -> list[dict[str, Any]]:
    """One entry per visible GPU (CUDA or ROCm; torch exposes both as 'cuda')."""
    if not torch.cuda.is_available():
        return []
    kind, runtime = accelerator_runtime()
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append({
            "index": i,
            "name": props.name,
            "kind": kind,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "runtime": runtime,
        })
    return out


def distributed_backends() -> dict[str, bool]:
    if not dist.is_available():
        return {b: False for b in DIST_BACKENDS}
    checks = {"nccl": dist.is_nccl_available, "gloo": dist.is_gloo_available, "mpi": dist.is_mpi_available}
    return {b: bool(checks[b]()) for b in DIST_BACKENDS}


def cpu_and_memory() -> dict[str, Any]:
    vm = psutil.virtual_memory()
    return {
        "model": cpu_model(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": psutil.cpu_count(logical=True),
        "usable_cores": usable_cores(),
        "ram_total_gib": round(vm.total / 2**30, 1),
        "ram_available_gib": round(vm.available / 2**30, 1),
    }


# ---------------------------------------------------------------- the report

def environment_report() -> dict[str, Any]:
    """Everything a reader should know about this machine before launching a distributed run."""
    kind, runtime = accelerator_runtime()
    return {
        "hostname": socket.gethostname(),
        "os": f"{platform.system()} {platform.release()}",
        "versions": package_versions(),
        "torch_built_for": f"{kind} {runtime}".strip(),
        "accelerators": accelerators(),
        "gpu_driver": gpu_driver_version(),
        "nccl": nccl_version(),
        "backends_available": distributed_backends(),
        "backend_used_here": backend_for(),
        "cpu": cpu_and_memory(),
    }


def report_table(report: Mapping[str, Any] | None = None):
    """The report as a two-level (section, item) -> value DataFrame for display in a notebook."""
    report = report if report is not None else environment_report()
    rows = [("versions", k, v) for k, v in report["versions"].items()]
    rows += [("accelerator", "torch built for", report["torch_built_for"]),
             ("accelerator", "driver", report["gpu_driver"]),
             ("accelerator", "NCCL/RCCL in torch", report["nccl"])]
    if not report["accelerators"]:
        rows.append(("accelerator", "devices", "none (CPU only)"))
    for gpu in report["accelerators"]:
        rows.append(("accelerator", f"gpu{gpu['index']}",
                     f"{gpu['name']} | {gpu['memory_gib']} GiB | {gpu['kind']} {gpu['runtime']}"
                     f" | compute capability {gpu['capability']}"))
    rows += [("distributed", f"{b} available", ok) for b, ok in report["backends_available"].items()]
    rows.append(("distributed", "backend used here", report["backend_used_here"]))
    rows += [("cpu", k, v) for k, v in report["cpu"].items()]
    rows += [("host", "hostname", report["hostname"]), ("host", "os", report["os"])]
    df = pd.DataFrame(rows, columns=["section", "item", "value"])
    df["value"] = df["value"].astype(str)  # mixed types would make the column object anyway
    return df


# ---------------------------------------------------------------- fingerprint across ranks

def fingerprint() -> dict[str, str]:
    """What must match across ranks (versions, runtimes, backends), plus what identifies the node.

    Values are strings so that ranks compare them exactly and JSON keeps them as they are."""
    kind, runtime = accelerator_runtime()
    gpus = accelerators()
    fp = dict(package_versions())
    fp.update({
        "torch_runtime": f"{kind} {runtime}".strip(),
        "nccl": nccl_version(),
        "dist_backends": ",".join(b for b, ok in distributed_backends().items() if ok) or "none",
        "torch_num_threads": str(torch.get_num_threads()),
        "hostname": socket.gethostname(),
        "devices": " / ".join(sorted({g["name"] for g in gpus})) or "cpu",
        "device_count": str(len(gpus)),
        "cpu_model": cpu_model(),
    })
    return {k: str(v) for k, v in fp.items()}


def compare_fingerprints(per_rank: Sequence[Mapping[str, str]]) -> list[dict[str, Any]]:
    """One row per field: the value on every rank, whether it differs, and whether that matters.

    `MISMATCH` is True only for a must-match field; an identifying field (hostname...) that
    differs is reported in `differs` but is expected across nodes."""
    fields = list(dict.fromkeys(k for fp in per_rank for k in fp))
    rows = []
    for name in fields:
        values = [fp.get(name, "<missing>") for fp in per_rank]
        differs = len(set(values)) > 1
        rows.append({
            "field": name,
            "must_match": name not in INFO_FIELDS,
            **{f"rank{r}": v for r, v in enumerate(values)},
            "differs": differs,
            "MISMATCH": differs and name not in INFO_FIELDS,
        })
    return rows


def fingerprint_table(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(list(rows))
