"""A CPU platform for verl 0.9.1, so that verl's own FSDP2 actor can be built in one CPU process (gloo).

Test infrastructure, not a supported way to train: verl has no CPU platform, and its rollout
(vLLM) cannot run on one. verl imports this module through its external-module hook
(VERL_USE_EXTERNAL_MODULES=verl_0_9_cpu_platform, with tests/ on PYTHONPATH) before any of its
workers ask for the platform, and VERL_PLATFORM=cpu selects it. Written against verl 0.9.1's
`verl.plugin.platform.PlatformBase` (every abstract method below); a new verl release is a review
of this file.

What it provides: the device name "cpu", gloo as the collective backend, and a device module
(torch.cpu with the memory counters verl logs, which torch.cpu lacks, reporting 0). The model must
also be built with `attn_implementation=sdpa` (verl's default asks for flash-attention) and
`use_remove_padding=False` (verl's remove-padding path needs flash-attention's varlen kernels):
`tests/integrations/test_verl_actor_runs_tethers_update.py` sets both, with the other settings the test needs.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Optional

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

VERIFIED_VERL = "0.9.1"


def _zero(*args, **kwargs) -> int:
    return 0


# torch.cpu plus what verl reads from its device module after every update: memory counters (0), a name.
CPU_DEVICE_MODULE = types.SimpleNamespace(
    **{
        **{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("_")},
        **dict(
            max_memory_allocated=_zero,
            max_memory_reserved=_zero,
            memory_allocated=_zero,
            memory_reserved=_zero,
            reset_peak_memory_stats=_zero,
            empty_cache=_zero,
            mem_get_info=lambda *a, **k: (0, 0),
            manual_seed=torch.manual_seed,
            manual_seed_all=torch.manual_seed,
            is_available=lambda: True,
            device_count=lambda: 1,
            current_device=lambda: "cpu",
            set_device=_zero,
            get_device_name=lambda *a: "CPU",
        ),  # verl's flops table has no CPU: its MFU metric reads 0
    }
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU: gloo collectives, no profiler, no IPC."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:
        # verl passes this wherever a device goes (`model.to(device=get_device_id())`); on the CPU that is "cpu".
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
