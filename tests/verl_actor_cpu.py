"""verl's own actor, one policy update on a fixed batch, in this CPU process: run by
tests/integrations/test_verl_actor_runs_tethers_update.py as `python tests/verl_actor_cpu.py BATCH OUT CASES`.

What runs is verl 0.9.1's: its Hydra config (`ppo_trainer`, with the OVERRIDEs), its
`ActorRolloutRefWorker` in the actor role (the worker main_ppo starts on every GPU), which builds
its FSDP2 engine around the model at `actor_rollout_ref.model.path`, its optimiser and `ppo_loss`,
and the route a batch takes from the trainer to the worker in verl's own trainer
(`RayPPOTrainer._update_actor`: `DataProto` -> TensorDict -> `left_right_2_no_padding` -> the
meta keys -> `update_actor`). What is not verl's: the process is one CPU process with a gloo
group of one instead of a Ray worker on a GPU (verl_0_9_cpu_platform.py, loaded through verl's
VERL_USE_EXTERNAL_MODULES hook, which the caller sets with VERL_PLATFORM=cpu), and the model is
built with sdpa attention and without remove-padding (both need flash-attention).

BATCH is a torch.save'd dict of (N, .) tensors in verl's layout: input_ids, attention_mask,
position_ids, prompts, responses, response_mask, old_log_probs, advantages (and the fields the
losses read through tether's ppo_loss hook: ref_log_prob, returns). CASES is a JSON file
{"common": [override, ...], "cases": {name: [override, ...]}}: one worker is built per case, from
the common overrides and its own, and makes one update from the same weights. OUT/<name>.pt
receives the weights before and after the update (full, unsharded), the metrics update_actor
returned, the policy-loss config verl's worker ran with, and the process group's size and backend.
"""

import json
import os
import sys
from pathlib import Path

import torch


def update_once(overrides: list[str], tensors: dict) -> dict:
    """Build verl's actor worker from ppo_trainer + `overrides` and make one update on `tensors`."""
    from hydra import compose, initialize_config_dir
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import verl
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import left_right_2_no_padding

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)
    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()

    def full_state() -> dict:
        module = worker.actor.engine.module
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().clone() for k, v in state.items()}

    before = full_state()
    a = cfg.actor_rollout_ref
    old_pass = _old_pass(cfg, worker, tensors)  # TROLL's: the driver's old pass, pi_old's sets (tether's hook)
    meta = {"temperature": a.rollout.temperature}
    if old_pass is not None:  # what the hook puts in the batch's meta_info for the update
        meta.update(old_pass.meta_info)
    data = DataProto.from_single_dict(dict(tensors), meta_info=meta)
    # verl's RayPPOTrainer._update_actor (verl/trainer/ppo/ray_trainer.py, 0.9.1), without Ray.
    td = left_right_2_no_padding(data.to_tensordict())
    mini = a.actor.ppo_mini_batch_size * a.rollout.n
    tu.assign_non_tensor(
        td,
        calculate_entropy=a.actor.calculate_entropy or a.actor.entropy_coeff != 0.0,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini,
        mini_batch_size=mini,
        epochs=a.actor.ppo_epochs,
        seed=a.actor.data_loader_seed,
        dataloader_kwargs={"shuffle": a.actor.shuffle},
        compute_loss=True,
    )
    metrics = tu.get(worker.update_actor(td), "metrics")
    policy_loss = worker.actor.loss_fn.keywords["config"].policy_loss
    return {
        "before": before,
        "after": full_state(),
        "metrics": {k: [float(x) for x in v] for k, v in metrics.items()},
        "policy_loss": {k: getattr(policy_loss, k, None) for k in ("loss_mode", "objective", "overrides")},
        "policy_loss_class": type(policy_loss).__qualname__,
        "old_pass": None if old_pass is None else {k: v.clone() for k, v in old_pass.batch.items()},
    }


def _old_pass(cfg, worker, tensors: dict):
    """For a tether objective with sparse supports (TROLL): verl's driver's `_compute_old_log_prob`, as tether's
    hook wraps it, on the batch, with this worker as the actor's worker group; else None."""
    from types import SimpleNamespace

    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from tether.integrations.verl import sparse_size

    if sparse_size(cfg.actor_rollout_ref.actor) is None:
        return None
    keep = ("input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask")
    batch = DataProto.from_single_dict({k: tensors[k] for k in keep}, meta_info={})
    batch.meta_info["temperature"] = cfg.actor_rollout_ref.rollout.temperature
    batch.meta_info["global_token_num"] = tensors["attention_mask"].sum(-1).tolist()  # as verl's fit() sets it
    driver = SimpleNamespace(config=cfg, actor_rollout_wg=worker)
    result, _ = RayPPOTrainer._compute_old_log_prob(driver, batch)
    return result


def main() -> None:
    batch_path, out_dir, cases_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    from verl.utils.device import get_device_name

    assert get_device_name() == "cpu", (
        "the CPU platform was not selected (VERL_PLATFORM=cpu, VERL_USE_EXTERNAL_MODULES)"
    )
    spec = json.loads(cases_path.read_text())
    tensors = torch.load(batch_path)
    # verl would init "cpu:gloo,cpu:gloo" (its CPU backend and the platform's), which torch refuses
    # as a duplicate; it skips its own init when a group exists. A Ray worker has one group too.
    torch.distributed.init_process_group("gloo")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, overrides in spec["cases"].items():
        result = update_once([*spec["common"], *overrides], tensors)
        result.update(
            world_size=torch.distributed.get_world_size(),
            backend=torch.distributed.get_backend(),
            device=get_device_name(),
        )
        torch.save(result, out_dir / f"{name}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
