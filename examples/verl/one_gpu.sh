#!/usr/bin/env bash
# A tether preset inside verl's own trainer on ONE GPU: main_ppo (Ray, vLLM rollouts, FSDP2 actor)
# trains a ~0.5B instruct model on tether's arithmetic task for a few steps and writes verl's
# metrics to OUT_DIR/metrics.jsonl. Nothing is downloaded: MODEL_PATH is a local model directory
# (for example Qwen2.5-0.5B-Instruct, fetched beforehand), the problems are tether's own.
#
#   bash examples/verl/one_gpu.sh MODEL_PATH OUT_DIR [HYDRA_OVERRIDE ...]
#   OBJECTIVE=rpg_urkl STEPS=10 bash examples/verl/one_gpu.sh ~/models/Qwen2.5-0.5B-Instruct runs/verl
#   DRY_RUN=1 bash examples/verl/one_gpu.sh MODEL_PATH OUT_DIR     # print the overrides, run nothing
#
# OBJECTIVE is any tether preset (default atr_grpo); it is verl's loss_mode tether_<preset>, and the
# advantage estimator and loss aggregation are the preset's own (docs/verl.md, "Names").
# benchmarks/verl_one_gpu.py runs this and turns the metrics into a table; benchmarks/gpu_all.py
# runs that when given --verl-model. Written against verl 0.9.1's config schema
# (tests/integrations/test_verl_plugin.py composes these overrides with it).
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: bash examples/verl/one_gpu.sh MODEL_PATH OUT_DIR [HYDRA_OVERRIDE ...]" >&2
  exit 2
fi
MODEL_PATH=$1
OUT_DIR=$2
shift 2
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
OBJECTIVE=${OBJECTIVE:-atr_grpo}
STEPS=${STEPS:-5}

if [[ "${DRY_RUN:-0}" != 1 && ! -f "$MODEL_PATH/config.json" ]]; then
  echo "MODEL_PATH '$MODEL_PATH' is not a local model directory (no config.json); this script downloads nothing" >&2
  exit 2
fi
# The preset's advantage estimator and aggregation (a preset that does not exist stops here, naming the valid ones).
read -r ADV AGG < <("$PYTHON" -c "from tether import objectives; c = objectives.build('$OBJECTIVE').config; print(c.advantage, c.aggregation)")

ARGS=(
  # ---- the tether part: the preset by its own name, its estimator and aggregation
  algorithm.adv_estimator="tether_$ADV"
  algorithm.use_kl_in_reward=False
  actor_rollout_ref.actor.policy_loss.loss_mode="tether_$OBJECTIVE"
  actor_rollout_ref.actor.loss_agg_mode="$AGG"
  actor_rollout_ref.actor.use_kl_loss=False
  actor_rollout_ref.actor.entropy_coeff=0
  # ---- data: tether's arithmetic task (examples/verl/make_data.py), scored by tether's math verifier
  data.train_files="$OUT_DIR/data/train.parquet"
  data.val_files="$OUT_DIR/data/val.parquet"
  data.prompt_key=prompt
  data.max_prompt_length=128
  data.max_response_length=256
  data.train_batch_size=16
  data.filter_overlong_prompts=True
  reward.custom_reward_function.path="$HERE/reward.py"
  reward.custom_reward_function.name=compute_score
  reward.num_workers=1
  # ---- model: sdpa attention and padded batches work without flash-attn; with flash-attn installed,
  # use_remove_padding=True and attn_implementation=flash_attention_2 are faster
  actor_rollout_ref.model.path="$MODEL_PATH"
  actor_rollout_ref.model.use_remove_padding=False
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa
  actor_rollout_ref.model.enable_gradient_checkpointing=True
  # ---- 4 optimiser steps per rollout batch (16 prompts / 4), so the ratio leaves 1 and the trust region acts
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.optim.clip_grad=1.0
  actor_rollout_ref.actor.ppo_mini_batch_size=4
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
  actor_rollout_ref.actor.use_dynamic_bsz=False
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
  # ---- vLLM rollouts on the same GPU: 4 samples per prompt
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.n=4
  actor_rollout_ref.rollout.temperature=1.0
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization=0.4
  # ---- one GPU, a few steps, metrics to a file
  trainer.nnodes=1
  trainer.n_gpus_per_node=1
  trainer.project_name=tether-verl-one-gpu
  trainer.experiment_name="$OBJECTIVE"
  trainer.logger='["console","file"]'
  trainer.val_before_train=False
  trainer.test_freq=-1
  trainer.save_freq=-1
  trainer.total_training_steps="$STEPS"
  trainer.default_local_dir="$OUT_DIR/checkpoints"
)

if [[ "${DRY_RUN:-0}" == 1 ]]; then
  printf '%s\n' "${ARGS[@]}" "$@"
  exit 0
fi

mkdir -p "$OUT_DIR"
"$PYTHON" "$HERE/make_data.py" "$OUT_DIR/data"
# verl's "file" logger writes one JSON line per step here.
VERL_FILE_LOGGER_PATH="$OUT_DIR/metrics.jsonl" "$PYTHON" -m verl.trainer.main_ppo "${ARGS[@]}" "$@"
echo "metrics: $OUT_DIR/metrics.jsonl"
