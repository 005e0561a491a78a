#!/usr/bin/env bash
# GPU check: on one CUDA GPU, time LeNet and ResNet-18 epochs on Fashion-MNIST-shaped data (60,000
# synthetic 1x28x28 images, batch 32 as in the lesson), without and with --amp, and print them beside the
# lesson's 1-GPU figures (LeNet 7.2 s/epoch, ResNet-18 26.0 s/epoch). About 4 minutes on an H200.
#   bash bench/gpu_check.sh        (from anywhere; creates .venv from requirements.txt if missing)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt; }
out=$(mktemp -d)
echo "model     amp   sec/epoch (median after epoch 1)   lesson, 1 GPU"
for model in lenet resnet18; do
  lesson=$([ "$model" = lenet ] && echo 7.2 || echo 26.0)
  for amp in --no-amp --amp; do
    .venv/bin/python ray_dp.py --gpu --workers 1 --dataset synthetic --synthetic-size 60000 --model "$model" \
      --batch-size 32 --lr 0.01 --epochs 2 --quiet "$amp" --storage-path "$out" --name "$model$amp" \
      --logdir "$out/tb" > "$out/$model$amp.log" 2>&1 || { tail -20 "$out/$model$amp.log"; exit 1; }
    seconds=$(.venv/bin/python -c "import json,sys; print(f\"{json.load(open(sys.argv[1]))['sec_per_epoch']:.1f}\")" \
      "$out/$model$amp/result.json")
    printf "%-9s %-5s %-34s %s\n" "$model" "${amp#--}" "$seconds" "$lesson"
  done
done
