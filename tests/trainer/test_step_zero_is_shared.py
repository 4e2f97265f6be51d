"""`trainer.step0_cache`: runs that start from the same model evaluate it once at step 0, and sharing changes no
number: a run that reads step 0 from the cache logs what it would have evaluated, and trains identically."""

from __future__ import annotations

from tether.trainer import step_zero
from tether.trainer.loop import train

from conftest import metrics_rows, train_config, untimed


def test_runs_from_one_model_share_step_zero_and_train_as_without(tiny_dir, tmp_path):
    cache = tmp_path / "step0"
    alone = train(train_config(tiny_dir, tmp_path / "alone", "trainer.total_steps=2"), log=lambda *_: None)
    first = train(
        train_config(tiny_dir, tmp_path / "first", "trainer.total_steps=2", f"trainer.step0_cache={cache}"),
        log=lambda *_: None,
    )
    assert len(list(cache.glob("*.json"))) == 1
    logs: list[str] = []
    other = train_config(
        tiny_dir,
        tmp_path / "other",
        "trainer.total_steps=2",
        f"trainer.step0_cache={cache}",
        "objective=dapo",  # another method, another learning rate, another sampling stream: the same step 0
        "trainer.lr=1e-3",
        "trainer.sampling_seed=5",
    )
    second = train(other, log=logs.append)
    assert any("(shared: evaluated once for this initial model" in line for line in logs), logs
    assert len(list(cache.glob("*.json"))) == 1
    assert metrics_rows(first)[0] == metrics_rows(second)[0] == metrics_rows(alone)[0]
    assert [untimed(r) for r in metrics_rows(first)] == [untimed(r) for r in metrics_rows(alone)]


def test_the_key_holds_what_step_zero_depends_on(tiny_dir, tmp_path):
    def key(*extra):
        return step_zero.key(train_config(tiny_dir, tmp_path, *extra))

    same = key()
    for setting in (
        "objective=dapo",
        "trainer.lr=1e-3",
        "rollout.temperature=0.5",
        "rollout.group_size=8",
        "trainer.seed=3",
        "trainer.total_steps=7",
    ):
        assert key(setting) == same, setting  # none of these changes the initial model or its evaluation
    for setting in ("data.eval_size=16", "rollout.max_new_tokens=9", "trainer.eval_batch_size=4", "model.lora.r=4"):
        assert key(setting) != same, setting
    # a warm start (or the built-in tiny model) makes the initial model depend on the seed
    tiny = ["model.name_or_path=tiny", "warm_start.enabled=true"]
    assert key(*tiny, "trainer.seed=3") != key(*tiny)
