"""Page-lock (pin) an existing host mapping for CUDA DMA with ``cudaHostRegister``, and count
the CUDA devices without torch.

torch is imported inside the functions, never at module import, so processes that never copy
to a GPU (the manager, the storage workers) never load it. Without torch or without a CUDA
device, ``register_host_memory`` returns False and callers fall back to pageable copies.
"""

from __future__ import annotations

import ctypes
import importlib.util
from types import ModuleType
from typing import Any

from kvoffload.logs import get_logger

log = get_logger()

_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault: mapped and portable under unified addressing


def cuda_device_count() -> int:
    """CUDA devices the driver shows this process, asked through libcuda with ctypes (cheap:
    no torch import); 0 without a driver, without a device, or on any driver error."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        if libcuda.cuInit(0) != 0 or libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return count.value


def _cuda_torch() -> ModuleType | None:
    """torch when it is installed and sees a CUDA device, else None."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any torch import failure means no CUDA
        log.warning("cuda_host_torch_unavailable", error=repr(exc))
        return None
    return torch if torch.cuda.is_available() else None


def _error_text(cudart: Any, err: Any) -> str:
    try:
        return str(cudart.cudaGetErrorString(cudart.cudaError(int(err))))
    except Exception:  # noqa: BLE001 - only for a message
        return f"cudaError {int(err)}"


def register_host_memory(address: int, size: int) -> bool:
    """Register ``size`` bytes at ``address`` with CUDA. True when registered; False when CUDA
    is absent or the call failed (logged as ``cuda_host_register_failed``). The caller must
    call ``unregister_host_memory`` before unmapping the memory."""
    torch = _cuda_torch()
    if torch is None:
        return False
    cudart = torch.cuda.cudart()
    try:
        err = cudart.cudaHostRegister(address, size, _REGISTER_DEFAULT)
    except Exception as exc:  # noqa: BLE001 - unregistered memory still works
        log.warning("cuda_host_register_failed", address=address, bytes=size, error=repr(exc))
        return False
    if int(err) != 0:
        log.warning(
            "cuda_host_register_failed",
            address=address,
            bytes=size,
            error=_error_text(cudart, err),
            code=int(err),
        )
        return False
    return True


def unregister_host_memory(address: int) -> None:
    """Undo ``register_host_memory``; failures are logged (``cuda_host_unregister_failed``),
    not raised, so unmapping can proceed."""
    torch = _cuda_torch()
    if torch is None:
        return
    cudart = torch.cuda.cudart()
    try:
        err = cudart.cudaHostUnregister(address)
    except Exception as exc:  # noqa: BLE001 - logged; the mapping goes anyway
        log.warning("cuda_host_unregister_failed", address=address, error=repr(exc))
        return
    if int(err) != 0:
        log.warning(
            "cuda_host_unregister_failed",
            address=address,
            error=_error_text(cudart, err),
            code=int(err),
        )
