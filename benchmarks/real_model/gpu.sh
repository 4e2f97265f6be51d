#!/usr/bin/env bash
# The real-model comparison and RL-step table on one GPU, in one command (estimated 8 minutes; not yet measured):
#   bash benchmarks/real_model/gpu.sh MODEL OUT_DIR [SEEDS] [STEPS]
# MODEL: SmolLM2-135M-Instruct as scripts/get_model.sh writes it (a directory), or its .gguf file.
# 1. `tether compare` of grpo, dapo, atr_grpo (ATR's KL3 clip), rpg_urkl (RPG) and etr (ETR) on
#    configs/real_model.yaml's task (word1: easy addition word problems, direct answers), at a GPU
#    budget: 16 prompts x 8 samples a step, STEPS steps (default 40), SEEDS seeds (default 3), 100
#    held-out problems every 10 steps, bf16 autocast; every run at once (`--jobs`: small runs share one GPU),
#    with eager decoding (rollout.compile=false: 15 runs compiling their decode at once on 16 cores did not
#    finish a step in 290 s on an H200; a 30-step run of a 135M model does not repay the compilation).
# 2. benchmarks/rl_step.py --real-model on the GPU (tether vs TRL's GRPOTrainer, LoRA, bf16).
# Each part has its own time limit, so one that hangs does not stop the other; OUT_DIR gets the
# compare directory (report.md, summary.json, plots/), rl_step.md, and each part's log.
set -uo pipefail
MODEL=${1:?usage: gpu.sh MODEL OUT_DIR [SEEDS] [STEPS]}
OUT=${2:?usage: gpu.sh MODEL OUT_DIR [SEEDS] [STEPS]}
SEEDS=${3:-3}
STEPS=${4:-40}
OBJECTIVES=grpo,dapo,atr_grpo,rpg_urkl,etr
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$ROOT"
JOBS=$(( SEEDS * 5 ))
timeout "${COMPARE_TIMEOUT:-330}" "$PY" -m tether.cli compare configs/real_model.yaml --objectives $OBJECTIVES \
  --seeds "$SEEDS" --jobs "$JOBS" --out "$OUT/compare" \
  model.name_or_path="$MODEL" trainer.device=cuda trainer.threads=1 rollout.compile=false \
  rollout.prompts_per_step=16 rollout.group_size=8 trainer.total_steps="$STEPS" trainer.mini_batches=2 \
  trainer.micro_batch_size=64 data.eval_size=100 trainer.eval_every=10 trainer.eval_batch_size=100 \
  trainer.save_every="$STEPS" trainer.progress=false trainer.tensorboard=false \
  > "$OUT/compare.log" 2>&1
status=$?
echo "compare: exit $status" | tee -a "$OUT/compare.log"
if [ "$status" != 0 ] && [ -d "$OUT/compare" ]; then  # out of time or a failed run: report what finished
  "$PY" -m tether.cli report "$OUT/compare" >> "$OUT/compare.log" 2>&1
  echo "report of the runs as they stand: exit $?" | tee -a "$OUT/compare.log"
fi
timeout "${RL_STEP_TIMEOUT:-150}" "$PY" benchmarks/rl_step.py --real-model --model "$MODEL" --device cuda \
  --dtype bfloat16 --steps 3 --out "$OUT/rl_step.md" > "$OUT/rl_step.log" 2>&1
echo "rl_step: exit $?" | tee -a "$OUT/rl_step.log"
