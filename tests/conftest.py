from pathlib import Path

import pytest
import torch

from tether.rewards import REWARDS, RewardResult

DIGIT_REWARD = "test_starts_with_digit"

# Real benchmark data beside the checkout (../shared/data/math); tests that read it skip without it.
MATH_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "math"
needs_math_data = pytest.mark.skipif(not MATH_DATA.is_dir(), reason=f"{MATH_DATA} not present")


def _starts_with_digit(completion, example):
    """A reward an untrained model earns about half the time: variance in every group."""
    ok = completion[:1].isdigit()
    return RewardResult(float(ok), {"digit": float(ok)})


if DIGIT_REWARD not in REWARDS:
    REWARDS.register(DIGIT_REWARD)(_starts_with_digit)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Llama model with a character tokenizer, saved locally (the from_pretrained path)."""
    from tether.models import init_model

    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, hidden_size=64, num_layers=2, num_heads=2, seed=0)
    return path


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
