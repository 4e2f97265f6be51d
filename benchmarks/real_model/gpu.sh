#!/usr/bin/env bash
# The real-model comparison (in the regime where the trust regions bind) and the RL-step table on one GPU, in one
# command that fits one 10-minute call (not yet measured on a GPU):
#   bash benchmarks/real_model/gpu.sh MODEL OUT_DIR [SEEDS] [STEPS] [JOBS]
# MODEL: SmolLM2-135M-Instruct as a model directory (scripts/get_model.sh writes one; a GPU machine that
#   reaches no registry needs it carried there), or its .gguf file.
# 1. `tether compare configs/real_model_compare.yaml` (16 optimiser updates per rollout batch, where DAPO's clip
#    binds on about 4% of tokens: benchmarks/results/real_model_compare_cpu/pilot/) of grpo, dapo, atr_grpo,
#    rpg_urkl and etr with the null control (grpo run twice), SEEDS seeds (default 6) x STEPS steps (default
#    12), bf16 autocast, eager decoding (rollout.compile=false: many runs compiling their decode at once on 16
#    CPU cores did not finish a step in 290 s; a short run of a 135M model does not repay compilation).
#    JOBS runs at a time (default 12, 1 CPU thread each: on 16 cores they do not starve one another, and a 135M
#    model's run takes a few GB of the GPU). The runs go seed by seed, so the runs finished at any moment are
#    whole seeds; every minute the report of the runs finished so far is rewritten in OUT_DIR/partial/, so a
#    call that runs out of time still leaves its results.
# 2. benchmarks/rl_step.py --real-model --packed on the GPU (tether padded, tether with trainer.packing=true and
#    TRL's GRPOTrainer side by side, LoRA, bf16; the padding share of each tether column).
# Each part has its own time limit (COMPARE_TIMEOUT, default 420 s; RL_STEP_TIMEOUT, 120 s), so one that hangs
# does not stop the other; OUT_DIR gets the compare directory, partial/, rl_step.md and each part's log.
set -uo pipefail
MODEL=${1:?usage: gpu.sh MODEL OUT_DIR [SEEDS] [STEPS] [JOBS]}
OUT=${2:?usage: gpu.sh MODEL OUT_DIR [SEEDS] [STEPS] [JOBS]}
SEEDS=${3:-6}
STEPS=${4:-12}
JOBS=${5:-12}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT/partial"
cd "$ROOT"

partial_report() {  # the report of the runs finished so far (`tether report` leaves out the runs still training)
  [ -d "$OUT/compare" ] && "$PY" -m tether.cli report "$OUT/compare" --claims configs/claims_real_model.yaml \
    --out "$OUT/partial" > "$OUT/partial/report.log" 2>&1
}

timeout "${COMPARE_TIMEOUT:-420}" "$PY" -m tether.cli compare configs/real_model_compare.yaml \
  --objectives grpo,dapo,atr_grpo,rpg_urkl,etr --null-control grpo --seeds "$SEEDS" --jobs "$JOBS" \
  --claims configs/claims_real_model.yaml --out "$OUT/compare" \
  model.name_or_path="$MODEL" trainer.device=cuda trainer.threads=1 rollout.compile=false \
  rollout.prompts_per_step=16 rollout.group_size=8 trainer.total_steps="$STEPS" trainer.micro_batch_size=64 \
  trainer.eval_batch_size=200 trainer.save_every="$STEPS" trainer.tensorboard=false \
  > "$OUT/compare.log" 2>&1 &
compare=$!
while kill -0 "$compare" 2>/dev/null; do
  sleep 60
  partial_report
done
wait "$compare"
status=$?
echo "compare: exit $status" | tee -a "$OUT/compare.log"
partial_report
echo "report of the runs finished: $OUT/partial/report.md" | tee -a "$OUT/compare.log"
timeout "${RL_STEP_TIMEOUT:-120}" "$PY" benchmarks/rl_step.py --real-model --model "$MODEL" --device cuda \
  --dtype bfloat16 --steps 3 --packed --out "$OUT/rl_step.md" > "$OUT/rl_step.log" 2>&1
echo "rl_step: exit $?" | tee -a "$OUT/rl_step.log"
