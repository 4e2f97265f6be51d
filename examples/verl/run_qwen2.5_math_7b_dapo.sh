#!/usr/bin/env bash
# A tether objective inside verl: Qwen2.5-Math-7B on DAPO-Math-17k, vLLM rollouts, FSDP training,
# several nodes of 8 GPUs. Run it on the Ray head node once every node has joined the cluster
# (see README.md beside this file). Written against verl 0.9.1's config schema; tests check that
# every override below exists there (tests/integrations/test_verl_plugin.py).
#
#   OBJECTIVE=rpg     tether_rpg_urkl: RPG-Style Clip, UKL to pi_old, R - group mean
#   OBJECTIVE=rpg_ref tether_rpg_urkl with the KL taken to the reference model instead
#   OBJECTIVE=atr     tether_atr_grpo: kl3 trust region, delta 0.0231
#   OBJECTIVE=etr     tether_etr: elastic per-sample clip ranges (a reconstruction)
# Every tether preset is a verl loss_mode by its own name, tether_<preset> (docs/verl.md).
#
# Extra Hydra overrides may follow on the command line; DRY_RUN=1 prints the overrides and exits.
set -euo pipefail

OBJECTIVE=${OBJECTIVE:-rpg}
MODEL_PATH=${MODEL_PATH:-$HOME/models/Qwen2.5-Math-7B}
DATA_DIR=${DATA_DIR:-$HOME/data}
TRAIN_FILE=${TRAIN_FILE:-$DATA_DIR/dapo-math-17k.parquet}
VAL_FILE=${VAL_FILE:-$DATA_DIR/aime-2024.parquet}
NNODES=${NNODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PROJECT=${PROJECT:-tether-verl}

# Qwen2.5-Math-7B has a 4096-token context: 1024 prompt + 3072 response.
MAX_PROMPT=1024
MAX_RESPONSE=3072
# Tokens per GPU in one dynamic micro-batch: two full-length sequences.
TOKENS_PER_GPU=$(( (MAX_PROMPT + MAX_RESPONSE) * 2 ))

# Per objective: verl loss_mode (tether_<preset>), verl advantage estimator (the preset's `advantage`).
USE_KL_LOSS=False
OVERRIDES="{}"
case "$OBJECTIVE" in
  rpg)     LOSS=tether_rpg_urkl; ADV=tether_dr_grpo ;;
  rpg_ref) LOSS=tether_rpg_urkl; ADV=tether_dr_grpo
           # anchor=ref needs ref_log_prob, which verl computes only with use_kl_loss; coef 0 keeps
           # verl's own KL term out of the loss (tether's RPG term is the regulariser).
           OVERRIDES="{anchor:ref,beta:0.001}"; USE_KL_LOSS=True ;;
  atr)     LOSS=tether_atr_grpo;  ADV=tether_grpo ;;
  etr)     LOSS=tether_etr;       ADV=tether_grpo ;;
  *) echo "OBJECTIVE must be rpg, rpg_ref, atr or etr (got '$OBJECTIVE')" >&2; exit 2 ;;
esac

ARGS=(
  # ---- the tether part
  algorithm.adv_estimator="$ADV"
  algorithm.use_kl_in_reward=False
  actor_rollout_ref.actor.policy_loss._target_=tether.integrations.verl.TetherPolicyLossConfig
  actor_rollout_ref.actor.policy_loss.loss_mode="$LOSS"
  +actor_rollout_ref.actor.policy_loss.overrides="$OVERRIDES"
  # Every tether preset above aggregates with token-mean; verl must use the same mode.
  actor_rollout_ref.actor.loss_agg_mode=token-mean
  actor_rollout_ref.actor.use_kl_loss="$USE_KL_LOSS"
  actor_rollout_ref.actor.kl_loss_coef=0.0
  actor_rollout_ref.actor.entropy_coeff=0
  # ---- data: DAPO-Math-17k (data_source math_dapo, scored by verl's math_dapo verifier), AIME 2024 for validation
  data.train_files="$TRAIN_FILE"
  data.val_files="$VAL_FILE"
  data.prompt_key=prompt
  data.max_prompt_length=$MAX_PROMPT
  data.max_response_length=$MAX_RESPONSE
  data.train_batch_size=512
  data.filter_overlong_prompts=True
  data.truncation=left
  # ---- model and optimiser: 16 updates per rollout batch (512 / 32), so ratios leave 1 and clipping acts
  actor_rollout_ref.model.path="$MODEL_PATH"
  actor_rollout_ref.model.use_remove_padding=True
  actor_rollout_ref.model.enable_gradient_checkpointing=True
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.optim.lr_warmup_steps=10
  actor_rollout_ref.actor.optim.weight_decay=0.1
  # verl 0.9.1's engine clips at optim.clip_grad; actor.grad_clip is not read (tests/integrations/test_verl_actor_runs_tethers_update.py)
  actor_rollout_ref.actor.optim.clip_grad=1.0
  actor_rollout_ref.actor.ppo_mini_batch_size=32
  actor_rollout_ref.actor.ppo_epochs=1
  actor_rollout_ref.actor.use_dynamic_bsz=True
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$TOKENS_PER_GPU
  actor_rollout_ref.actor.fsdp_config.param_offload=False
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
  actor_rollout_ref.ref.fsdp_config.param_offload=True
  # ---- vLLM rollouts: 16 samples per prompt
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.n=16
  actor_rollout_ref.rollout.temperature=1.0
  actor_rollout_ref.rollout.top_p=1.0
  actor_rollout_ref.rollout.tensor_model_parallel_size=2
  actor_rollout_ref.rollout.gpu_memory_utilization=0.7
  actor_rollout_ref.rollout.max_num_batched_tokens=$TOKENS_PER_GPU
  actor_rollout_ref.rollout.calculate_log_probs=True
  actor_rollout_ref.rollout.val_kwargs.n=8
  actor_rollout_ref.rollout.val_kwargs.do_sample=True
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0
  actor_rollout_ref.rollout.val_kwargs.top_p=0.7
  # ---- cluster and logging
  trainer.nnodes=$NNODES
  trainer.n_gpus_per_node=$GPUS_PER_NODE
  trainer.project_name="$PROJECT"
  trainer.experiment_name="qwen2.5-math-7b-dapo-$OBJECTIVE"
  trainer.logger='["console","wandb"]'
  trainer.val_before_train=True
  trainer.test_freq=10
  trainer.save_freq=50
  trainer.total_training_steps=500
)

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  printf '%s\n' "${ARGS[@]}" "$@"
  exit 0
fi

python3 -m verl.trainer.main_ppo "${ARGS[@]}" "$@"
