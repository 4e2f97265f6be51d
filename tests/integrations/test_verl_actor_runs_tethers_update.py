"""verl's own actor trains with tether's losses (issue 34): verl 0.9.1's `ActorRolloutRefWorker`, its
FSDP2 engine on a gloo group of one CPU process, makes one policy update on a fixed batch, and its
loss and parameter update equal tether's own trainer's (`tether.trainer.step.update`) on the same batch:

- a preset by its own name (`loss_mode=tether_atr_grpo`, verl's plain PolicyLossConfig);
- DAPO through TetherPolicyLossConfig with Hydra overrides, which also equals verl's native `vanilla`
  loss with the same clip ranges;
- RPG anchored to the reference and ETR, whose losses read `ref_log_prob` and `returns` from the
  micro-batch through tether's `ppo_loss` hook, inside verl's worker.

verl runs in a child process (tests/verl_actor_cpu.py), because its CPU platform
(tests/verl_0_9_cpu_platform.py) must be chosen before verl's engine module is imported and the
process group must be the worker's own. Both sides use SGD (the update is lr x the gradient, so the
parameter updates compare the gradients) in float32.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

from tether import objectives  # noqa: E402
from tether.model.causal_lm import LogProbSettings, Precision, Tokens, positions, token_logprobs  # noqa: E402
from tether.model.loading import init_model, load_model  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
DRIVER = TESTS / "verl_actor_cpu.py"
G, PROMPTS, P, T = 4, 2, 4, 6  # samples per prompt, prompts, prompt and response widths
LR = 1.0
TROLL = {"preset": "troll", "top_k": 8, "eps": 0.002}  # a bound the batch's perturbed pi_old crosses


# verl overrides every case shares: the tiny model, sdpa attention and no remove-padding (both
# need flash-attention otherwise), float32 FSDP2, SGD, no gradient clipping (verl 0.9.1 clips with
# optim.clip_grad; actor.grad_clip is not read by its engine), one mini-batch of the
# whole batch in micro-batches of 2 rows, no shuffling.
def _common(model_dir: Path) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        f"data.train_batch_size={PROMPTS}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        f"actor_rollout_ref.rollout.n={G}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_dynamic_bsz=False",
        "actor_rollout_ref.actor.shuffle=False",
        "actor_rollout_ref.actor.optim.optimizer=SGD",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.optim.weight_decay=0",
        "actor_rollout_ref.actor.optim.clip_grad=1e9",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.use_kl_loss=False",
    ]


TETHER_TARGET = "actor_rollout_ref.actor.policy_loss._target_=tether.integrations.verl.TetherPolicyLossConfig"
LOSS = "actor_rollout_ref.actor.policy_loss"
# name -> (verl overrides, the tether objective spec tether's trainer runs)
CASES = {
    "atr_grpo": ([f"{LOSS}.loss_mode=tether_atr_grpo"], "atr_grpo"),
    "dapo": (
        [TETHER_TARGET, f"{LOSS}.loss_mode=tether_dapo", f"+{LOSS}.overrides={{dual_clip_c:3.0}}"],
        {"preset": "dapo", "dual_clip_c": 3.0},
    ),
    "vanilla": (
        [
            f"{LOSS}.loss_mode=vanilla",
            "actor_rollout_ref.actor.clip_ratio_low=0.2",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.clip_ratio_c=3.0",
        ],
        {"preset": "dapo", "dual_clip_c": 3.0},
    ),
    # verl puts ref_log_prob in the micro-batch with use_kl_loss; kl_loss_coef=0 keeps its own KL term out.
    "rpg_ref": (
        [
            TETHER_TARGET,
            f"{LOSS}.loss_mode=tether_rpg_urkl",
            f"+{LOSS}.overrides={{anchor:ref,beta:0.05}}",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_coef=0",
        ],
        {"preset": "rpg_urkl", "anchor": "ref", "beta": 0.05},
    ),
    "etr": ([f"{LOSS}.loss_mode=tether_etr"], "etr"),
    # TROLL: pi_old's sets from verl's driver's old pass through tether's hook (compared with tether's own sets of
    # the same weights, which the batch carries to the update), the supports from the FSDP engine's logits.
    "troll": ([TETHER_TARGET, f"{LOSS}.loss_mode=tether_troll", f"+{LOSS}.overrides={{top_k:8,eps:0.002}}"], TROLL),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(model_dir: Path) -> dict:
    """A fixed rollout batch in verl's layout, [left-padded prompt | right-padded response], which is
    also tether's (`Tokens`): 2 prompts x 4 samples, rewards with variance in both groups, old
    log-probs off the current policy by up to ~0.5 nats (so clips act), a reference below them."""
    g = torch.Generator().manual_seed(0)
    model, _ = load_model(str(model_dir), dtype="float32")
    V, N = model.config.vocab_size, G * PROMPTS
    prompt_len = torch.tensor([4, 4, 4, 4, 2, 2, 2, 2])  # each group shares its prompt
    resp_len = torch.tensor([6, 2, 5, 6, 1, 4, 6, 3])
    prompt_mask = torch.arange(P)[None] >= (P - prompt_len)[:, None]
    resp_mask = torch.arange(T)[None] < resp_len[:, None]
    prompts = torch.randint(3, V, (PROMPTS, P), generator=g).repeat_interleave(G, 0) * prompt_mask
    responses = torch.randint(3, V, (N, T), generator=g) * resp_mask
    attention = torch.cat([prompt_mask, resp_mask], 1).long()
    tokens = Tokens(
        torch.cat([prompts, responses], 1), attention, positions(attention), responses, resp_mask.float(), P
    )
    with torch.no_grad():
        lp, _ = token_logprobs(model, tokens, LogProbSettings(share_prompts=False))
    old = (lp + 0.5 * (torch.rand(N, T, generator=g) - 0.5)) * resp_mask
    ref = (lp - 0.2 * torch.rand(N, T, generator=g)) * resp_mask
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    token_rewards = torch.zeros(N, T)
    token_rewards[torch.arange(N), resp_len - 1] = rewards
    # What verl's driver computes: tether's estimator (advantages, and ETR's statistic in `returns`).
    from verl.trainer.ppo import core_algos

    uids = [f"prompt-{i // G}" for i in range(N)]
    adv, returns = core_algos.get_adv_estimator_fn("tether_grpo")(
        token_level_rewards=token_rewards, response_mask=resp_mask, index=uids
    )
    from tether.integrations.verl_compat import SET_FIELDS
    from tether.model.support import old_with_set

    with torch.no_grad():  # pi_old's sets, as tether's trainer keeps them (TROLL's case reads them)
        _, sets = old_with_set(
            model, tokens, LogProbSettings(share_prompts=False), objectives.build(TROLL).config.sparse_support()
        )
    return {
        **dict(zip(SET_FIELDS, sets)),
        "input_ids": tokens.input_ids,
        "attention_mask": attention,
        "position_ids": tokens.position_ids,
        "prompts": prompts,
        "responses": responses,
        "response_mask": resp_mask.long(),
        "old_log_probs": old.float(),
        "advantages": adv.float(),
        "ref_log_prob": ref.float(),
        "returns": returns.float(),
        "token_level_rewards": token_rewards,
        # tether's side only (not sent to verl):
        "_rewards": rewards,
        "_groups": torch.arange(N) // G,
        "_tokens": tokens,
    }


@pytest.fixture(scope="module")
def verl_updates(tmp_path_factory):
    """(batch, model dir, {case: verl's result}) from one child process that runs every case."""
    tmp = tmp_path_factory.mktemp("verl_actor")
    model_dir = init_model(tmp / "tiny", hidden_size=32, num_layers=2, num_heads=2, seed=0)
    batch = _batch(model_dir)
    torch.save({k: v for k, v in batch.items() if not k.startswith("_")}, tmp / "batch.pt")
    (tmp / "cases.json").write_text(
        json.dumps({"common": _common(model_dir), "cases": {k: v[0] for k, v in CASES.items()}})
    )
    repo = str(TESTS.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([repo, str(TESTS), os.environ.get("PYTHONPATH", "")]),
        # verl's hooks: import the CPU platform with verl and select it; the FSDP engine class that
        # verl registers for "cuda" is the one it builds (VERL_ENGINE_DEVICE picks the registration).
        "VERL_USE_EXTERNAL_MODULES": "verl_0_9_cpu_platform",
        "VERL_PLATFORM": "cpu",
        "VERL_ENGINE_DEVICE": "cuda",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    out = subprocess.run(
        [sys.executable, str(DRIVER), str(tmp / "batch.pt"), str(tmp / "out"), str(tmp / "cases.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return batch, model_dir, {k: torch.load(tmp / "out" / f"{k}.pt", weights_only=False) for k in CASES}


def _tether_update(model_dir: Path, batch: dict, spec) -> tuple[dict, dict]:
    """tether's own trainer's update (`tether.trainer.update.update`) on the same batch: (metrics, weights after)."""
    from tether.config.loading import load_config
    from tether.core.troll import SparseSet
    from tether.integrations.verl_compat import SET_FIELDS
    from tether.trainer.update import Policy, UpdateBatch, update

    model, _ = load_model(str(model_dir), dtype="float32")
    obj = objectives.build(spec)
    cfg = load_config(
        None,
        [
            f"model.name_or_path={model_dir}",
            "trainer.ppo_epochs=1",
            "trainer.mini_batches=1",
            f"trainer.micro_batch_size={G}",
            "trainer.max_grad_norm=0",
        ],
    )
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    ub = UpdateBatch(
        tokens=batch["_tokens"],
        advantages=batch["advantages"],
        rewards=batch["_rewards"],
        group_ids=batch["_groups"],
        old_logprobs=batch["old_log_probs"],
        ref_logprobs=batch["ref_log_prob"] if obj.uses_reference() else None,
        old_set=SparseSet(*(batch[k] for k in SET_FIELDS)) if obj.config.sparse_support() else None,
    )
    cpu = torch.device("cpu")
    schedule = torch.optim.lr_scheduler.LambdaLR(sgd, lambda _: 1.0)
    policy = Policy(model, None, sgd, schedule, cpu, Precision.of("off", cpu), LogProbSettings(share_prompts=False))
    metrics, _ = update(policy, obj, ub, cfg.trainer, torch.Generator().manual_seed(0))
    return metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_update(verl_result: dict, tether_after: dict, before: dict) -> None:
    # float32 weights near 1 (the norms) carry ~1e-7 of rounding in (after - before); the updates are
    # 5e-4 to 0.16 here, and gradient clipping at verl's default (1.0) would shrink them all by 16%.
    for name, start in before.items():
        torch.testing.assert_close(
            verl_result["after"][name] - start, tether_after[name] - start, rtol=1e-4, atol=1e-6, msg=name
        )


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != "vanilla"])
def test_verl_actor_update_equals_tethers_trainer(verl_updates, case):
    batch, model_dir, results = verl_updates
    result = results[case]
    assert (result["device"], result["world_size"], result["backend"]) == ("cpu", 1, "gloo")
    before = {k: v.clone() for k, v in load_model(str(model_dir), dtype="float32")[0].state_dict().items()}
    for name, w in before.items():  # verl's FSDP2 engine loaded the same weights
        torch.testing.assert_close(result["before"][name], w, rtol=0, atol=0)
    metrics, after = _tether_update(model_dir, batch, CASES[case][1])
    # verl logs the policy loss of the mini-batch as the sum of its micro-batches' shares.
    (pg_loss,) = result["metrics"]["actor/pg_loss"]
    assert pg_loss == pytest.approx(metrics["loss/total"], rel=1e-5, abs=1e-7)
    assert abs(metrics["loss/total"]) > 1e-3
    _assert_same_update(result, after, before)
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-3  # a case whose update is 0 would test nothing
    if case in ("atr_grpo", "dapo"):  # the trust region acted on this batch
        assert metrics["policy/clipfrac_low"] + metrics["policy/clipfrac_high"] > 0
        assert "actor/tether/policy/clipfrac_high" in result["metrics"]
    if case == "etr":
        assert "actor/tether/etr/eps_high_mean" in result["metrics"]
    if case == "troll":  # verl's old pass, through tether's hook, kept the sets tether's trainer keeps
        from tether.integrations.verl_compat import SET_FIELDS

        old = result["old_pass"]
        ids, logp, keep = (old[k] for k in SET_FIELDS)
        assert (ids.dtype, logp.dtype, keep.dtype) == (torch.int32, torch.float32, torch.bool)  # 9 K bytes a token
        assert torch.equal(keep, batch[SET_FIELDS[2]]) and torch.equal(
            torch.where(keep, ids.long(), 0), torch.where(keep, batch[SET_FIELDS[0]].long(), 0)
        )
        torch.testing.assert_close(logp[keep], batch[SET_FIELDS[1]][keep].to(logp.dtype), rtol=0, atol=1e-5)
        assert "actor/tether/troll/projected_frac" in result["metrics"] and metrics["troll/projected_frac"] > 0


@pytest.mark.slow
def test_verl_actor_tether_dapo_equals_verls_native_vanilla(verl_updates):
    _, _, results = verl_updates
    ours, theirs = results["dapo"], results["vanilla"]
    assert ours["policy_loss_class"] == "TetherPolicyLossConfig" and ours["policy_loss"]["overrides"] == {
        "dual_clip_c": 3.0
    }
    assert theirs["policy_loss"]["loss_mode"] == "vanilla"
    assert ours["metrics"]["actor/pg_loss"] == pytest.approx(theirs["metrics"]["actor/pg_loss"], rel=1e-6)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert ours["metrics"][key] == pytest.approx(theirs["metrics"][key], rel=1e-6, abs=1e-9), key
    assert theirs["metrics"]["actor/pg_clipfrac"][0] > 0
    for name, start in ours["before"].items():
        torch.testing.assert_close(ours["after"][name] - start, theirs["after"][name] - start, rtol=1e-5, atol=1e-8)
