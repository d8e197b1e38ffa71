"""Network presets: the NCCL and gloo variables one kind of network needs, as data, selected by name.

    LaunchSpec(..., network="lan-ethernet")   # every launch target exports the preset's variables

The presets live in `network_presets.yaml` beside this module (shipped as package data): `lan-ethernet`
(TCP sockets on one LAN interface, InfiniBand off), `cloud-no-rdma` (cloud GPUs whose NICs have no RDMA:
sockets, more TCP streams per peer) and `rdma-infiniband` (IB/RoCE HCAs with GPUDirect RDMA). Each
variable has a value and a one-line reason, which the generated scripts print above its `export`. A
variable that the spec's own `env` sets keeps the spec's value (an interface name, say), so a preset is a
starting point, not a cage. An unknown name raises an error that lists the valid ones.

`loopback_ifname()` names this machine's loopback interface (`lo` on Linux, `lo0` on macOS and the BSDs),
which GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME need when every "node" of a job runs on localhost.
"""

from __future__ import annotations

import functools
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from distlab import yaml_input

PRESETS_FILE = Path(__file__).with_name("network_presets.yaml")
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]*$")
_VAR_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")


class NetworkPresetError(ValueError):
    """An unknown preset name, or a presets file that breaks the format above."""


@dataclass(frozen=True)
class NetworkPreset:
    name: str
    description: str
    env: dict[str, str]  # name -> value, in the file's order
    reasons: dict[str, str]  # name -> one line: why the variable is set


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict[str, NetworkPreset]:
    data = yaml_input.load_file(path)
    if not isinstance(data, dict) or not data:
        raise NetworkPresetError(f"{path}: expected a mapping of preset names")
    presets = {}
    for name, body in data.items():
        where = f"{path}: preset {name!r}"
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise NetworkPresetError(f"{where}: names are lower-case words joined by '-'")
        if not isinstance(body, dict) or set(body) != {"description", "env"}:
            raise NetworkPresetError(f"{where}: needs exactly 'description' and 'env'")
        if not isinstance(body["env"], dict) or not body["env"]:
            raise NetworkPresetError(f"{where}: 'env' must map variable names to {{value, reason}}")
        env, reasons = {}, {}
        for var, item in body["env"].items():
            if not isinstance(var, str) or not _VAR_RE.match(var):
                raise NetworkPresetError(f"{where}: {var!r} is not an upper-case variable name")
            if not isinstance(item, dict) or set(item) != {"value", "reason"}:
                raise NetworkPresetError(f"{where}: {var} needs exactly 'value' and 'reason'")
            value, reason = item["value"], item["reason"]
            if not isinstance(value, str):
                raise NetworkPresetError(f"{where}: {var}'s value {value!r} must be a quoted string")
            if not isinstance(reason, str) or not reason.strip() or "\n" in reason.strip():
                raise NetworkPresetError(f"{where}: {var} needs a one-line reason")
            env[var], reasons[var] = value, reason.strip()
        presets[name] = NetworkPreset(name, str(body["description"]).strip(), env, reasons)
    return presets


def presets(path: str | Path = PRESETS_FILE) -> dict[str, NetworkPreset]:
    """Every preset in the file, by name (read once per process)."""
    return dict(_load(str(path)))


def get_preset(name: str) -> NetworkPreset:
    """The preset called `name`; an unknown name raises NetworkPresetError listing the valid ones."""
    known = presets()
    if name not in known:
        raise NetworkPresetError(f"unknown network preset {name!r}; one of {', '.join(sorted(known))}")
    return known[name]


def describe(name: str | None = None) -> str:
    """Markdown: each preset (or the one named), its variables, values and reasons."""
    lines = []
    for preset in ([get_preset(name)] if name else presets().values()):
        lines += [f"**{preset.name}**: {preset.description}.", ""]
        lines += [f"- `{var}={value}`: {preset.reasons[var]}" for var, value in preset.env.items()]
        lines.append("")
    return "\n".join(lines)


LOOPBACK_ADDRESS = "127.0.0.1"


def loopback_ifname() -> str:
    """The name of this machine's loopback interface, read from the system: the interface flagged loopback
    that carries 127.0.0.1 (gloo binds to the interface named, so it must be the one holding that address).
    When the system cannot say, the usual name for this platform (default_loopback)."""
    import psutil  # deferred: only a localhost launch asks for interfaces; reading presets needs no psutil

    try:
        flags = {name: stats.flags.split(",") for name, stats in psutil.net_if_stats().items()}
        addresses = psutil.net_if_addrs()
    except (OSError, psutil.Error):  # a sandbox that hides the interfaces
        flags, addresses = {}, {}
    loopbacks = [name for name, words in flags.items() if "loopback" in words]
    for name in loopbacks:
        if any(a.family == socket.AF_INET and a.address == LOOPBACK_ADDRESS for a in addresses.get(name, ())):
            return name
    return loopbacks[0] if loopbacks else default_loopback()


def default_loopback(platform: str = sys.platform) -> str:
    """The loopback's usual name on `platform` (a sys.platform value): lo0 on macOS and the BSDs, lo on Linux."""
    return "lo0" if platform == "darwin" or "bsd" in platform else "lo"
