#!/usr/bin/env bash
# One device call: train the GroupNorm ResNet-20 of the zoo on a GPU within a time budget, then run
# benchmarks/speed.py on that GPU. Every stage writes into $OUT as it goes, so a run stopped at its
# limit still returns what it finished. Inputs travel in .gpu/ (ignored by git):
#   .gpu/train.pack.npz  (tools/npz_transport.py pack of cifar10_train_jpeg75.npz)
#   .gpu/cifar10_test.npz and .gpu/checkpoints/akamaster/resnet20-12fca82f.th (copies from ../shared/data)
# Usage: tools/gpu_session.sh TRAIN_SECONDS SPEED_SECONDS [DEVICE]
set -u
TRAIN_S=${1:?train seconds} SPEED_S=${2:?speed seconds} DEV=${3:-cuda}
OUT=${OUT:-/tmp/aqr-gpu-out}; mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 AQR_SHARED_DATA=$PWD/.gpu
exec > >(tee -a "$OUT/session.log") 2>&1
date -u; nvidia-smi -L 2>/dev/null; $PY -c "import torch, numpy, PIL; print('torch', torch.__version__, 'numpy', numpy.__version__, 'PIL', PIL.__version__, 'cuda', torch.cuda.is_available())"

DATA=/tmp/cifar10_train_jpeg75.npz
$PY tools/npz_transport.py unpack .gpu/train.pack.npz $DATA || $PY tools/npz_transport.py unpack --allow-mismatch .gpu/train.pack.npz $DATA
ARGS=(--model resnet20 --norm gn --model-kwargs '{"groups": 8}' --data $DATA --test .gpu/cifar10_test.npz
      --batch-size 128 --lr 0.1 --nesterov --weight-decay 5e-4 --warmup-epochs 1 --seed 0 --device $DEV)
# Seconds per epoch from a short probe run (its second half, after the GPU's warm-up), then as many
# epochs as fit the budget, so the cosine schedule is complete.
EPOCHS=$($PY - "$TRAIN_S" "$DEV" "$DATA" <<'PY'
import sys, time
from aqr.train import TrainConfig, train
budget, dev, data = float(sys.argv[1]), sys.argv[2], sys.argv[3]
steps = 60
cfg = TrainConfig(model="resnet20", norm="gn", model_kwargs={"groups": 8}, data=data, device=dev, epochs=1,
                  limit_train=128 * steps, batch_size=128)
train(cfg, log=open("/dev/null", "w"))
t = time.perf_counter(); train(cfg, log=open("/dev/null", "w")); per_step = (time.perf_counter() - t) / steps
epoch = per_step * 390 + 1.0  # + evaluation of 10,000 test images and the state file
print(max(1, min(200, int(budget / (1.1 * epoch)))))
print(f"probe: {per_step * 1e3:.1f} ms/step, ~{epoch:.1f} s/epoch", file=sys.stderr)
PY
)
echo "epochs: $EPOCHS"
mkdir -p "$OUT/work"
$PY -m aqr train "${ARGS[@]}" --epochs "$EPOCHS" --work-dir "$OUT/work" --out "$OUT/resnet20_gn.pt"
rm -f "$OUT/work/last.pt"  # only needed if the run was cut short
date -u
if [ "$DEV" != cpu ]; then
  timeout "$SPEED_S" $PY benchmarks/speed.py --device "$DEV" --repeats 20 --json "$OUT/speed_gpu.json"
else
  timeout "$SPEED_S" $PY benchmarks/speed.py --quick --skip-calibration --json "$OUT/speed_gpu.json"
fi
date -u
