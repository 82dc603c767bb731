"""Which GPUs this host has, and what they offer (torch-free; torch used when present).

Probing order, first one that finds devices wins:
  1. torch.cuda (when torch is importable and sees a GPU): what the kernels will really run on.
  2. the driver libraries through ctypes: libcuda.so.1, libamdhip64.so (no torch needed, e.g. setup.py).
  3. the vendor tools' text output: nvidia-smi, rocminfo.
Every failure is quiet, because a CPU-only host is normal, but each step records
why it found nothing (`probe_notes()`), so the report can say e.g.
"no NVIDIA driver (libcuda.so.1 not found)".
"""
from __future__ import annotations

import ctypes
import importlib.util
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import List, Optional

from . import smem_cap
from .archs import Arch, amd_arch, nvidia_arch, parse_arch


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    vendor: str  # "nvidia" | "amd"
    name: str
    arch: Arch
    sm_count: Optional[int]  # SMs (NVIDIA) or CUs (AMD); None when the probe cannot tell
    warp_size: Optional[int]  # 32, or 64 on CDNA wave64
    smem_per_block_optin: Optional[int]  # bytes a block may opt in to (AMD: LDS per workgroup)
    total_memory: Optional[int]  # bytes
    driver_version: Optional[str]
    runtime_version: Optional[str]
    source: str  # "torch" | "libcuda" | "hip" | "nvidia-smi" | "rocminfo" | "fake"
    # The device's own opt-in limit where PORTATTN_MAX_SMEM_KIB lowered smem_per_block_optin
    # (capability/smem_cap.py), else None.
    smem_per_block_optin_uncapped: Optional[int] = None


_notes: List[str] = []


def probe_notes() -> List[str]:
    """Why the last `probe_devices` call found what it found (one line per step tried)."""
    return list(_notes)


def no_gpu_reason() -> str:
    """One line for "No GPU found: <why>", from the last probe."""
    return "; ".join(_notes) if _notes else "no probe has run"


_cache: dict = {}


def cached_devices(prefer_torch: bool = True) -> List[DeviceInfo]:
    """`probe_devices` once per process (dispatch's path: GPUs do not come and go)."""
    if prefer_torch not in _cache:
        _cache[prefer_torch] = (probe_devices(prefer_torch), probe_notes())
    return list(_cache[prefer_torch][0])


def device_info(index: Optional[int] = None) -> Optional[DeviceInfo]:
    """The (cached) DeviceInfo of GPU `index`; None = torch's current device when torch is
    loaded, else GPU 0. Returns None when there is no such GPU. For a backend's
    `unsupported_reasons`: matrix.check_call(name, probe.device_info(i), call, build_config)."""
    if index is None:
        torch = sys.modules.get("torch")
        try:
            index = torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else 0
        except Exception:
            index = 0
    devices = cached_devices()
    return devices[index] if 0 <= index < len(devices) else None


def probe_devices(prefer_torch: bool = True) -> List[DeviceInfo]:
    """Every visible GPU, or [] (never raises). See `probe_notes()` for why. NVIDIA GPUs report
    the shared-memory budget PORTATTN_MAX_SMEM_KIB leaves them (`with_smem_cap`)."""
    _notes.clear()
    devices = _probe_devices(prefer_torch)
    error = smem_cap.config_error()
    if error and devices:
        _notes.append(f"{error}; the devices' own limits are shown")
    return [with_smem_cap(d) for d in devices]


def with_smem_cap(device: DeviceInfo, cap: Optional[int] = None) -> DeviceInfo:
    """`device` with the shared-memory budget of PORTATTN_MAX_SMEM_KIB (or `cap` bytes):
    smem_per_block_optin lowered to it, the device's own limit kept beside it."""
    cap = smem_cap.cap_bytes() if cap is None else cap
    own = device.smem_per_block_optin_uncapped or device.smem_per_block_optin
    budget = smem_cap.capped(own, device.vendor, cap)
    if budget == device.smem_per_block_optin:
        return device
    return replace(device, smem_per_block_optin=budget,
                   smem_per_block_optin_uncapped=own if budget != own else None)


def _probe_devices(prefer_torch: bool) -> List[DeviceInfo]:
    steps = []
    if prefer_torch:
        steps.append(_probe_torch)
    steps += [_probe_libcuda, _probe_hip, _probe_nvidia_smi, _probe_rocminfo]
    found_by_vendor = {}
    for step in steps:
        try:
            devices = step()
        except Exception as exc:  # a probe must never break the caller
            _notes.append(f"{step.__name__[7:]}: failed ({type(exc).__name__}: {exc})")
            continue
        if devices:
            # The first source for a vendor wins; a host with both vendors keeps both.
            vendor = devices[0].vendor
            if step is _probe_torch:
                return devices
            if vendor not in found_by_vendor:
                found_by_vendor[vendor] = devices
    result: List[DeviceInfo] = []
    for devices in found_by_vendor.values():
        result += [replace(d, index=len(result) + i) for i, d in enumerate(devices)]
    return result


# ---------------------------------------------------------------------------------------------
# 1. torch


def _probe_torch() -> List[DeviceInfo]:
    if not torch_installed():
        _notes.append("torch not installed")
        return []
    import torch

    if not torch.cuda.is_available():
        build = "ROCm" if torch.version.hip else ("CUDA" if torch.version.cuda else "CPU-only")
        _notes.append(f"torch {torch.__version__} ({build} build) sees no GPU")
        return []
    is_hip = bool(torch.version.hip)
    runtime = torch.version.hip if is_hip else torch.version.cuda
    driver = _cuda_driver_version() if not is_hip else None
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        if is_hip:
            arch = _amd_arch_or_unknown(getattr(p, "gcnArchName", ""))
            warp = getattr(p, "warp_size", 64)
        else:
            arch = nvidia_arch(p.major, p.minor)
            warp = getattr(p, "warp_size", 32)
        # Some ROCm releases report 0 opt-in memory; the plain per-block limit is then the limit.
        smem = getattr(p, "shared_memory_per_block_optin", None) or getattr(p, "shared_memory_per_block", None)
        devices.append(
            DeviceInfo(
                index=i,
                vendor="amd" if is_hip else "nvidia",
                name=p.name,
                arch=arch,
                sm_count=p.multi_processor_count,
                warp_size=warp,
                smem_per_block_optin=smem,
                total_memory=p.total_memory,
                driver_version=driver,
                runtime_version=runtime,
                source="torch",
            )
        )
    return devices


def torch_installed() -> bool:
    """Whether `import torch` can work, without importing it."""
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None  # None: deliberately blocked
    try:
        return importlib.util.find_spec("torch") is not None
    except ValueError:
        return False


def _amd_arch_or_unknown(gcn_arch_name: str) -> Arch:
    try:
        return amd_arch(gcn_arch_name)
    except ValueError:
        return Arch("amd", gcn_arch_name or "gfx?", (0, 0, 0), "unknown", False, "unparseable gcnArchName")


# ---------------------------------------------------------------------------------------------
# 2. driver libraries through ctypes

# CUdevice_attribute values (cuda.h; stable since they were introduced).
_CU_ATTR_WARP_SIZE = 10
_CU_ATTR_MULTIPROCESSOR_COUNT = 16
_CU_ATTR_CC_MAJOR = 75
_CU_ATTR_CC_MINOR = 76
_CU_ATTR_MAX_SMEM_PER_BLOCK_OPTIN = 97


def _load(names):
    last = None
    for name in names:
        try:
            return ctypes.CDLL(name), None
        except OSError as exc:
            last = exc
    return None, last


def _cuda_error(lib, code: int) -> str:
    msg = ctypes.c_char_p()
    try:
        if lib.cuGetErrorString(code, ctypes.byref(msg)) == 0 and msg.value:
            return f"{msg.value.decode(errors='replace')} (CUresult {code})"
    except AttributeError:
        pass
    return f"CUresult {code}"


def _cuda_driver_version() -> Optional[str]:
    lib, _ = _load(["libcuda.so.1", "libcuda.so", "nvcuda.dll"])
    if lib is None:
        return None
    v = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
        return None
    return f"{v.value // 1000}.{(v.value % 1000) // 10}"


def _probe_libcuda() -> List[DeviceInfo]:
    lib, err = _load(["libcuda.so.1", "libcuda.so", "nvcuda.dll"])
    if lib is None:
        _notes.append("no NVIDIA driver (libcuda.so.1 not found)")
        return []
    rc = lib.cuInit(0)
    if rc != 0:
        _notes.append(f"NVIDIA driver present but cuInit failed: {_cuda_error(lib, rc)}")
        return []
    count = ctypes.c_int()
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0 or count.value == 0:
        _notes.append("NVIDIA driver present but it reports no device" + (f" ({_cuda_error(lib, rc)})" if rc else ""))
        return []
    driver = _cuda_driver_version()
    devices = []
    for i in range(count.value):
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), i) != 0:
            continue

        def attr(a: int) -> Optional[int]:
            v = ctypes.c_int()
            return v.value if lib.cuDeviceGetAttribute(ctypes.byref(v), a, dev) == 0 else None

        name = ctypes.create_string_buffer(256)
        lib.cuDeviceGetName(name, 256, dev)
        mem = ctypes.c_size_t()
        total = mem.value if lib.cuDeviceTotalMem_v2(ctypes.byref(mem), dev) == 0 else None
        devices.append(
            DeviceInfo(
                index=i,
                vendor="nvidia",
                name=name.value.decode(errors="replace"),
                arch=nvidia_arch(attr(_CU_ATTR_CC_MAJOR) or 0, attr(_CU_ATTR_CC_MINOR) or 0),
                sm_count=attr(_CU_ATTR_MULTIPROCESSOR_COUNT),
                warp_size=attr(_CU_ATTR_WARP_SIZE),
                smem_per_block_optin=attr(_CU_ATTR_MAX_SMEM_PER_BLOCK_OPTIN),
                total_memory=total,
                driver_version=driver,
                runtime_version=None,
                source="libcuda",
            )
        )
    return devices


# hipDeviceAttribute_t values of ROCm >= 5. The enum has been reordered across
# releases, so every value read through them is range-checked and dropped
# (None) when implausible; rocminfo, when present, is preferred for them.
_HIP_ATTR_MULTIPROCESSOR_COUNT = 63
_HIP_ATTR_MAX_SMEM_PER_BLOCK = 74
_HIP_ATTR_WARP_SIZE = 87


def _probe_hip() -> List[DeviceInfo]:
    lib, err = _load(["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"])
    if lib is None:
        _notes.append("no ROCm runtime (libamdhip64.so not found)")
        return []
    count = ctypes.c_int()
    rc = lib.hipGetDeviceCount(ctypes.byref(count))
    if rc != 0 or count.value == 0:
        _notes.append(f"ROCm runtime present but it reports no device (hipError {rc})")
        return []
    drv, rt = ctypes.c_int(), ctypes.c_int()
    driver = str(drv.value) if lib.hipDriverGetVersion(ctypes.byref(drv)) == 0 else None
    runtime = str(rt.value) if lib.hipRuntimeGetVersion(ctypes.byref(rt)) == 0 else None
    agents = _rocminfo_agents()
    devices = []
    for i in range(count.value):

        def attr(a: int, lo: int, hi: int) -> Optional[int]:
            v = ctypes.c_int()
            ok = lib.hipDeviceGetAttribute(ctypes.byref(v), a, i) == 0
            return v.value if ok and lo <= v.value <= hi else None

        name = ctypes.create_string_buffer(256)
        lib.hipDeviceGetName(name, 256, i)
        mem = ctypes.c_size_t()
        total = mem.value if lib.hipDeviceTotalMem(ctypes.byref(mem), i) == 0 else None
        agent = agents[i] if i < len(agents) else {}
        gfx = agent.get("gfx") or _hip_gcn_arch_name(lib, i)
        warp = attr(_HIP_ATTR_WARP_SIZE, 32, 64)
        devices.append(
            DeviceInfo(
                index=i,
                vendor="amd",
                name=name.value.decode(errors="replace") or agent.get("name", "AMD GPU"),
                arch=_amd_arch_or_unknown(gfx or ""),
                sm_count=agent.get("cus") or attr(_HIP_ATTR_MULTIPROCESSOR_COUNT, 1, 4096),
                warp_size=agent.get("wave") or (warp if warp in (32, 64) else None),
                smem_per_block_optin=agent.get("lds") or attr(_HIP_ATTR_MAX_SMEM_PER_BLOCK, 16384, 1 << 20),
                total_memory=total,
                driver_version=driver,
                runtime_version=runtime,
                source="hip",
            )
        )
    return devices


_GFX_IN_BYTES = re.compile(rb"gfx[0-9a-f]{3,4}(?::[a-z]+[+-])*\x00")


def _hip_gcn_arch_name(lib, index: int) -> Optional[str]:
    """gcnArchName without depending on hipDeviceProp_t's layout (it changed in ROCm 6):
    the struct is filled into an oversized buffer and the one gfx string in it is found."""
    buf = ctypes.create_string_buffer(1 << 14)
    try:
        if lib.hipGetDeviceProperties(buf, index) != 0:
            return None
    except AttributeError:
        return None
    m = _GFX_IN_BYTES.search(buf.raw)
    return m.group(0)[:-1].decode() if m else None


# ---------------------------------------------------------------------------------------------
# 3. vendor tools


def _run_tool(argv: List[str]) -> Optional[str]:
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def parse_nvidia_smi(text: str) -> List[DeviceInfo]:
    """Parses `nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version
    --format=csv,noheader,nounits` (memory in MiB)."""
    devices = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        idx, name, cc, mem_mib, driver = parts
        try:
            arch = parse_arch(cc)
        except ValueError:
            continue
        devices.append(
            DeviceInfo(
                index=int(idx),
                vendor="nvidia",
                name=name,
                arch=arch,
                sm_count=None,
                warp_size=32,
                smem_per_block_optin=None,
                total_memory=int(float(mem_mib)) * (1 << 20) if mem_mib.replace(".", "").isdigit() else None,
                driver_version=driver,
                runtime_version=None,
                source="nvidia-smi",
            )
        )
    return devices


def _probe_nvidia_smi() -> List[DeviceInfo]:
    text = _run_tool(
        ["nvidia-smi", "--query-gpu=index,name,compute_cap,memory.total,driver_version", "--format=csv,noheader,nounits"]
    )
    if text is None:
        _notes.append("nvidia-smi not available")
        return []
    devices = parse_nvidia_smi(text)
    if not devices:
        _notes.append("nvidia-smi lists no usable GPU")
    return devices


_AGENT_SPLIT = re.compile(r"^\*+\s*\n\s*Agent \d+\s*\n\*+", re.MULTILINE)


def parse_rocminfo(text: str) -> List[dict]:
    """GPU agents of `rocminfo` output, in order: {"gfx", "name", "cus", "wave", "lds"}."""
    agents = []
    for block in _AGENT_SPLIT.split(text)[1:]:
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() not in fields:
                fields[key.strip()] = value.strip()
        if fields.get("Device Type") != "GPU":
            continue
        agent = {"gfx": fields.get("Name", ""), "name": fields.get("Marketing Name", "")}
        m = re.match(r"(\d+)", fields.get("Compute Unit", ""))
        agent["cus"] = int(m.group(1)) if m else None
        m = re.match(r"(\d+)", fields.get("Wavefront Size", ""))
        agent["wave"] = int(m.group(1)) if m else None
        # LDS is the GROUP segment pool: "Segment: GROUP" then "Size: 64(0x40) KB".
        m = re.search(r"Segment:\s*GROUP\s*\n\s*Size:\s*(\d+)\(0x[0-9a-f]+\)\s*KB", block)
        agent["lds"] = int(m.group(1)) * 1024 if m else None
        agents.append(agent)
    return agents


def _rocminfo_agents() -> List[dict]:
    text = _run_tool(["rocminfo"])
    return parse_rocminfo(text) if text else []


def _probe_rocminfo() -> List[DeviceInfo]:
    if shutil.which("rocminfo") is None:
        _notes.append("rocminfo not available")
        return []
    agents = _rocminfo_agents()
    if not agents:
        _notes.append("rocminfo lists no GPU agent")
    return [
        DeviceInfo(
            index=i,
            vendor="amd",
            name=a["name"] or a["gfx"],
            arch=_amd_arch_or_unknown(a["gfx"]),
            sm_count=a["cus"],
            warp_size=a["wave"],
            smem_per_block_optin=a["lds"],
            total_memory=None,
            driver_version=None,
            runtime_version=None,
            source="rocminfo",
        )
        for i, a in enumerate(agents)
    ]


# ---------------------------------------------------------------------------------------------
# Fake devices for tests and `portattn-report --device-desc`: numbers as the real parts report them.

_KIB = 1024
_GIB = 1 << 30

_FAKES = {
    # kind: (vendor, name, arch, SMs/CUs, warp, smem opt-in, memory, runtime)
    "a100": ("nvidia", "NVIDIA A100-SXM4-80GB", "sm80", 108, 32, 163 * _KIB, 80 * _GIB, "12.8"),
    "rtx3090": ("nvidia", "NVIDIA GeForce RTX 3090", "sm86", 82, 32, 99 * _KIB, 24 * _GIB, "12.8"),
    "rtx4090": ("nvidia", "NVIDIA GeForce RTX 4090", "sm89", 128, 32, 99 * _KIB, 24 * _GIB, "12.8"),
    "l4": ("nvidia", "NVIDIA L4", "sm89", 58, 32, 99 * _KIB, 22 * _GIB, "12.8"),
    "h100": ("nvidia", "NVIDIA H100 80GB HBM3", "sm90", 132, 32, 227 * _KIB, 80 * _GIB, "12.8"),
    "h200": ("nvidia", "NVIDIA H200", "sm90", 132, 32, 227 * _KIB, 141 * _GIB, "12.8"),
    "b200": ("nvidia", "NVIDIA B200", "sm100", 148, 32, 227 * _KIB, 180 * _GIB, "12.8"),
    "rtx5090": ("nvidia", "NVIDIA GeForce RTX 5090", "sm120", 170, 32, 99 * _KIB, 32 * _GIB, "12.8"),
    "gb10": ("nvidia", "NVIDIA GB10", "sm121", 48, 32, 99 * _KIB, 119 * _GIB, "13.0"),
    "t4": ("nvidia", "Tesla T4", "sm75", 40, 32, 64 * _KIB, 15 * _GIB, "12.8"),
    "mi250x": ("amd", "AMD Instinct MI250X", "gfx90a:sramecc+:xnack-", 110, 64, 64 * _KIB, 64 * _GIB, "6.3"),
    "mi300x": ("amd", "AMD Instinct MI300X", "gfx942:sramecc+:xnack-", 304, 64, 64 * _KIB, 192 * _GIB, "6.3"),
    "rx7900xtx": ("amd", "AMD Radeon RX 7900 XTX", "gfx1100", 96, 32, 64 * _KIB, 24 * _GIB, "6.3"),
}

FAKE_DEVICE_KINDS = tuple(_FAKES)


def fake_device(kind: str, index: int = 0) -> DeviceInfo:
    """A DeviceInfo as the named part would report it (kinds: FAKE_DEVICE_KINDS)."""
    key = kind.strip().lower().replace(" ", "").replace("-", "").replace("_", "")
    if key not in _FAKES:
        raise ValueError(f"unknown fake device {kind!r}; known: {', '.join(FAKE_DEVICE_KINDS)}")
    vendor, name, arch, sms, warp, smem, mem, runtime = _FAKES[key]
    return DeviceInfo(
        index=index,
        vendor=vendor,
        name=name,
        arch=parse_arch(arch),
        sm_count=sms,
        warp_size=warp,
        smem_per_block_optin=smem,
        total_memory=mem,
        driver_version=None,
        runtime_version=runtime,
        source="fake",
    )
