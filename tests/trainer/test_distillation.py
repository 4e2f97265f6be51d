"""On-policy distillation through tether's trainer (the `teacher` section, `objective.distill`;
docs/algorithms/distillation.md), on tiny models:

1. end to end: a tiny student distils from a tiny teacher of another size (objective=opd, and forward_kl_topk)
   through `train`; the distillation metrics are in metrics.jsonl, finite, and the student's weights move;
2. the teacher is frozen: eval mode, no parameter requires a gradient or is in the optimiser, and after two steps
   of a run its weights are bitwise those on disk and no gradient was ever stored on it;
3. the teacher's scores of a step's batch are its own log-probs of the student's tokens at the sampling temperature,
   with its top-k, from its full softmax; the update's student log-probs at those ids are the student's own;
4. refusals, each a ConfigError naming the problem and the fix: a teacher whose tokenizer differs from the
   student's (before the run directory exists), a top-k teacher whose head scores another vocabulary size.
   (The config's own refusals are tests/config/test_teacher_config.py.)
5. the flat-step warning of a distilling run says the teacher's signal trained (such a step is never skipped);
6. learning: 25 steps of pure distillation lower the divergence on the student's own samples (metrics.jsonl).
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import metrics_rows, train_config
from tether.schema import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny teacher of another size and seed than the student (`tiny_dir`), with the same character tokenizer."""
    from tether.model.loading import init_model

    return init_model(tmp_path_factory.mktemp("teacher") / "teacher", hidden_size=32, num_layers=1, num_heads=2, seed=1)


def _teacher_weights(teacher_dir):
    return load_file(str(teacher_dir / "model.safetensors"))


@pytest.mark.parametrize(
    "objective",
    [
        ["objective=opd"],
        ["objective=dapo", "objective.distill.signal=forward_kl_topk", "objective.distill.topk=4"],
    ],
    ids=["opd", "dapo+forward_kl_topk"],
)
def test_a_tiny_student_distils_from_a_teacher_through_the_trainer(tiny_dir, teacher_dir, tmp_path, objective):
    from tether.trainer.loop import train

    before = _teacher_weights(teacher_dir)
    cfg = train_config(
        tiny_dir, tmp_path / "run", "trainer.total_steps=2", f"teacher.name_or_path={teacher_dir}", *objective
    )
    run = train(cfg, log=lambda *_: None)
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    keys = ["distill/reverse_kl", "distill/k3", "time/teacher_logprobs_s", "loss/total"]
    keys += ["distill/advantage_mean"] if objective == ["objective=opd"] else ["loss/distill", "distill/teacher_mass"]
    for row in rows[1:]:
        for key in keys:
            assert key in row and math.isfinite(row[key]), key
        assert row["time/teacher_logprobs_s"] > 0 and row["optim/flat_skipped"] == 0.0  # a teacher is never flat
        assert row["distill/k3"] >= 0
    if objective != ["objective=opd"]:
        assert all(0 < r["distill/teacher_mass"] <= 1 + 1e-6 and r["loss/distill"] >= 0 for r in rows[1:])
    start, end = (
        load_file(str(tiny_dir / "model.safetensors")),
        load_file(str(run / "checkpoints" / "step_000002" / "model" / "model.safetensors")),
    )
    assert any(not torch.equal(start[k], end[k]) for k in start)  # the student trained
    after = _teacher_weights(teacher_dir)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the teacher's files did not
    assert not (run / "checkpoints" / "step_000002" / "teacher").exists()


def _started(tiny_dir, teacher_dir, tmp_path, *extra):
    from tether.trainer.setup import start_run

    cfg = train_config(tiny_dir, tmp_path / "run", f"teacher.name_or_path={teacher_dir}", *extra)
    return cfg, start_run(cfg, log=lambda *_: None)


def test_the_teacher_is_frozen_and_never_trained(tiny_dir, teacher_dir, tmp_path):
    from tether.trainer.step import rl_step

    cfg, run = _started(
        tiny_dir,
        teacher_dir,
        tmp_path,
        "objective=dapo",
        "objective.distill.signal=forward_kl_topk",
        "objective.distill.topk=4",
        "trainer.total_steps=2",
    )
    teacher, policy = run.parts.teacher.model, run.parts.policy
    try:
        assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
        in_optimiser = {id(p) for group in policy.optimizer.param_groups for p in group["params"]}
        assert not in_optimiser & {id(p) for p in teacher.parameters()}
        student_before = {k: v.clone() for k, v in policy.model.state_dict().items()}
        for step in (1, 2):
            _, metrics = rl_step(run.parts, run.progress.counters, step)
            assert math.isfinite(float(metrics["loss/distill"])) and float(metrics["loss/distill"]) > 0
        on_disk = _teacher_weights(teacher_dir)
        now = teacher.state_dict()
        assert all(torch.equal(now[k].cpu(), on_disk[k]) for k in on_disk)  # bitwise what it loaded
        assert all(p.grad is None for p in teacher.parameters())  # no gradient ever reached it
        assert not teacher.training
        assert any(not torch.equal(v, policy.model.state_dict()[k]) for k, v in student_before.items())
    finally:
        run.parts.source.sampler.close()


def test_the_teachers_scores_are_its_own_log_probs_of_the_students_tokens(tiny_dir, teacher_dir, tmp_path):
    from tether.model.causal_lm import head_pass
    from tether.trainer import seeds
    from tether.trainer.step import collect, tokens_for_update

    k, tau = 5, 0.7
    cfg, run = _started(
        tiny_dir,
        teacher_dir,
        tmp_path,
        "objective=dapo",
        "objective.distill.signal=forward_kl_topk",
        f"objective.distill.topk={k}",
        f"rollout.temperature={tau}",
    )
    parts = run.parts
    try:
        scored, _ = collect(parts.source, cfg.rollout, seeds.rollout(seeds.sampling_root(cfg.trainer), 1))
        tokens, _ = tokens_for_update(scored, parts)
        scores = parts.teacher.scores(parts.policy, tokens)
    finally:
        parts.source.sampler.close()
    keep = tokens.loss_mask.bool()
    assert keep.sum() > 0

    def full_logsoftmax(model):  # (N, T, V), the model's own logits at the sampling temperature
        T, P = tokens.completion_ids.shape[1], tokens.prompt_len
        with torch.no_grad():
            logits = model(
                input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, position_ids=tokens.position_ids
            ).logits[:, P - 1 : P - 1 + T]
        return torch.log_softmax(logits.double() / tau, -1)

    teacher_full = full_logsoftmax(parts.teacher.model)
    sampled = teacher_full.gather(-1, tokens.completion_ids[..., None])[..., 0]
    torch.testing.assert_close(scores.logprobs[keep].double(), sampled[keep], rtol=1e-5, atol=1e-5)
    top = teacher_full.topk(k, -1)
    torch.testing.assert_close(scores.topk_logprobs[keep].double(), top.values[keep], rtol=1e-5, atol=1e-5)
    assert torch.equal(scores.topk_ids[keep], top.indices[keep])
    assert not scores.logprobs[~keep].any() and not scores.topk_logprobs[~keep].any()
    # the update's pass: the student's log-probs at the teacher's ids, from the student's own softmax
    student = head_pass(parts.policy.model, tokens, parts.policy.logprob_settings, False, gather_ids=scores.topk_ids)
    want = full_logsoftmax(parts.policy.model).gather(-1, scores.topk_ids)
    torch.testing.assert_close(student.gathered[keep].double(), want[keep], rtol=1e-5, atol=1e-5)
    assert student.gathered.requires_grad


def test_a_teacher_with_another_tokenizer_is_refused_before_the_run_directory_exists(tiny_dir, tmp_path):
    from tether.model.loading import DEFAULT_CHARSET, init_model
    from tether.trainer.loop import train

    other = init_model(tmp_path / "other", hidden_size=32, num_layers=1, num_heads=2, charset=DEFAULT_CHARSET[::-1])
    cfg = train_config(tiny_dir, tmp_path / "run", "objective=opd", f"teacher.name_or_path={other}")
    with pytest.raises(ConfigError) as err:
        train(cfg, log=lambda *_: None)
    message = str(err.value)
    assert "cannot teach this student" in message and "ids that differ" in message
    assert "the teacher must use the student's tokenizer" in message  # the fix: a teacher of the student's family
    assert not (tmp_path / "run").exists()


def test_a_top_k_teacher_whose_head_scores_another_vocabulary_is_refused(tiny_dir, teacher_dir, tmp_path):
    # Same tokenizer, a head padded to more rows (as Qwen2.5's sizes differ): the sampled tokens' log-probs are
    # comparable, the top-k ids are not (the teacher may rank a padding row).
    from tether.model.loading import load_model

    model, tokenizer = load_model(teacher_dir)
    model.resize_token_embeddings(model.get_output_embeddings().weight.shape[0] + 8)
    padded = tmp_path / "padded"
    model.save_pretrained(padded)
    tokenizer.save_pretrained(padded)
    with pytest.raises(
        ConfigError, match=r"its output head scores \d+ tokens, the student's \d+.*reverse_kl or kl_loss"
    ):
        _started(tiny_dir, padded, tmp_path, "objective=dapo", "objective.distill.signal=forward_kl_topk")
    _, run = _started(tiny_dir, padded, tmp_path / "sampled", "objective=opd")  # the sampled tokens' signal: fine
    run.parts.source.sampler.close()


def test_the_flat_step_warning_says_a_distilling_step_still_trained():
    # every group flat (adv/zero_var_frac 1) but the step distilled: not "the weights moved only by the KL penalty"
    from tether.config.loading import load_config
    from tether.trainer.loop import FLAT_WARN_AFTER, flat_streak

    cfg = load_config(None, [])
    metrics = {"adv/zero_var_frac": 1.0, "reward/mean": 0.0, "optim/flat_skipped": 0.0, "distill/reverse_kl": 0.3}
    streak, line = flat_streak(metrics, cfg.rollout, cfg.trainer.log_every_steps, FLAT_WARN_AFTER - 1)
    assert streak == FLAT_WARN_AFTER and "moved by the teacher's signal alone (objective.distill)" in line
    assert "KL penalty" not in line


@pytest.mark.parametrize(
    "objective, metric",
    [
        (["objective=opd"], "distill/k3"),
        (["objective=opd", "objective.distill.signal=forward_kl_topk", "objective.distill.tail=true"], "loss/distill"),
    ],
    ids=["opd", "forward_kl_topk+tail"],
)
def test_the_student_moves_towards_the_teacher(tiny_dir, teacher_dir, tmp_path, objective, metric):
    # 25 steps of pure distillation (no task reward): the divergence on the student's own samples falls, the
    # reverse KL's k3 estimate (opd) by about half, the (k + 1)-outcome forward KL by about ten times.
    from tether.trainer.loop import train

    extra = ["trainer.total_steps=25", "trainer.eval_every=100", "trainer.save_every=100", "objective.distill.topk=8"]
    cfg = train_config(tiny_dir, tmp_path / "run", f"teacher.name_or_path={teacher_dir}", *objective, *extra)
    rows = metrics_rows(train(cfg, log=lambda *_: None))[1:]
    first, last = (sum(r[metric] for r in part) / len(part) for part in (rows[:5], rows[-5:]))
    assert last < 0.7 * first, (first, last)
