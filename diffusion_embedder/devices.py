"""Device names checked before any work: a name torch cannot parse, or a device this machine lacks, is refused in
our words with the devices it has (torch would fail later, deep in a ``.to()``, naming neither)."""

from __future__ import annotations

import torch


def available_devices() -> list[str]:
    """The devices this process can use: ``cpu``, then every visible CUDA device, then ``mps`` where present."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    return found


def _missing(device: torch.device) -> str | None:
    """Why ``device`` is not on this machine (None when it is, or when its type is one torch checks itself)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device is visible"
            return f"CUDA is not available here ({build}, torch {torch.__version__})"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"there are {torch.cuda.device_count()} CUDA device(s), so no index {device.index}"
    if device.type == "mps" and "mps" not in available_devices():
        return "MPS is not available here"
    return None


def check_device(device: str | torch.device, argument: str = "device") -> torch.device:
    """``device`` as a ``torch.device``; a ValueError naming ``argument``, the value and the devices there are."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"{argument}={device!r} is not a device name ({error}); available: {', '.join(available_devices())}."
        ) from None
    why = _missing(parsed)
    if why:
        raise ValueError(f"{argument}={device!r}: {why}; available: {', '.join(available_devices())}.")
    return parsed
