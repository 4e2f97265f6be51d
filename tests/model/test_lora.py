"""LoRA in tether's own trainer (issue 18, item 3): only the adapters train, the reference is the
base model with the adapters disabled (no second copy), checkpoints hold the adapter, and a killed
run resumes exactly."""

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from tether.schema import ConfigError  # noqa: E402
from tether.config.loading import load_config  # noqa: E402
from tether.trainer.loop import train  # noqa: E402

from conftest import tiny_run, untimed  # noqa: E402


def _cfg(tiny_dir, out, *extra):
    lora = ["model.lora={r: 4, alpha: 8}", "objective={preset: rpg_urkl, anchor: ref, beta: 0.05}"]
    update = ["trainer.mini_batches=2", "trainer.micro_batch_size=8", "trainer.lr=1e-2", "trainer.eval_every=2"]
    quiet = ["trainer.progress=false", "trainer.plots=false", "trainer.save_every=1"]
    return load_config(None, tiny_run(tiny_dir, *update, *quiet, *lora, *extra, out=out))


def _rows(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def test_the_reference_is_the_base_model_with_adapters_disabled(tiny_dir):
    from tether.config.sections import LoRAConfig
    from tether.model.loading import apply_lora, load_model

    base, _ = load_model(str(tiny_dir))
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        want = base(ids).logits
    peft = apply_lora(base, LoRAConfig(r=4))
    model = peft.get_base_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # a trained adapter
        moved = model(ids).logits
        with peft.disable_adapter():
            ref = model(ids).logits
    torch.testing.assert_close(ref, want, rtol=0, atol=0)  # the base weights, bitwise
    assert (moved - want).abs().max() > 1e-3
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.slow
def test_lora_training_checkpoints_the_adapter_and_resumes_exactly(tiny_dir, tmp_path):
    full = train(_cfg(tiny_dir, tmp_path / "full", "trainer.total_steps=3"), log=lambda *_: None)
    model_dir = full / "checkpoints" / "step_000003" / "model"
    assert (model_dir / "adapter_config.json").exists() and (model_dir / "adapter_model.safetensors").exists()
    assert not (model_dir / "model.safetensors").exists()  # the adapter only, not the weights
    assert not (full / "checkpoints" / "step_000003" / "reference.safetensors").exists()  # no second copy
    rows = _rows(full)
    assert all(math.isfinite(r["kl/ref"]) for r in rows[1:]) and rows[-1]["kl/ref"] > 0  # the policy moved off the base
    part = train(_cfg(tiny_dir, tmp_path / "part", "trainer.total_steps=2"), log=lambda *_: None)
    resumed = train(
        _cfg(tiny_dir, tmp_path / "part", "trainer.total_steps=3"), resume_dir=str(part), log=lambda *_: None
    )
    for a, b in zip(_rows(full), _rows(resumed)):  # time/*: wall clock
        assert untimed(a) == untimed(b)


def test_lora_cannot_refresh_its_reference():
    with pytest.raises(ConfigError, match="model.lora with trainer.ref_update_every"):
        load_config(None, ["model.lora={r: 4}", "trainer.ref_update_every=5"])


def test_the_warm_start_cache_key_does_not_depend_on_lora():
    # LoRA is applied after the warm start: turning it on must reuse the cached warm start.
    from tether.trainer.warmstart import _key, warm_start_key

    plain, lora = load_config(None, []), load_config(None, ["model.lora={r: 8}"])
    assert _key(warm_start_key(plain, "tiny")) == _key(warm_start_key(lora, "tiny"))
    assert "lora" not in warm_start_key(plain, "tiny")["base"]
