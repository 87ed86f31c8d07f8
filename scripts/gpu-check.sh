#!/usr/bin/env bash
# The GPU checks, on a machine with one or more GPUs and a CUDA build of torch
# in the environment (see README.md, Quick start).  Under 10 minutes:
#   1. the default training job on CUDA (one rank per GPU), NCCL bootstrapped
#      from MPI, and its device settings (cuda.*) as logged;
#   2. bench allreduce on NCCL (hpcnet's transport and reducer against raw
#      torch.distributed NCCL), 1-100 MiB;
#   3. bench train: hpcnet against DDP-NCCL on resnet50, batch 64 a GPU, bf16;
#   4. the default job with dist.zero=2 and AdamW (sharded state on CUDA, NCCL);
# then prints a summary table.  Everything goes under ${GPU_CHECK_OUT:-gpu-check}/
# (logs and JSON).  Usage: scripts/gpu-check.sh [number of ranks; default: GPUs]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
out="${GPU_CHECK_OUT:-gpu-check}"
mkdir -p "$out"
python - <<'EOF' | tee "$out/devices.txt"
import torch
if not torch.cuda.is_available():
    raise SystemExit(f"gpu-check: no CUDA device visible to torch {torch.__version__} "
                     f"(a CPU build? see README.md, Quick start)")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
EOF
gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
np="${1:-$gpus}"
run() {  # name, timeout, command...
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*"
    local start=$SECONDS status=0
    timeout "$limit" "$@" > "$out/$name.log" 2>&1 || status=$?
    echo "$name $status $((SECONDS - start))" >> "$out/status.txt"
    tail -n 4 "$out/$name.log"
}
: > "$out/status.txt"
run train 150 mpirun -np "$np" python -m mpi4py -m hpcnet.train train.steps=200 train.eval_every=100 \
    run.dir="$out/runs" checkpoint.dir="$out/ckpt" checkpoint.move_aside=true
run allreduce 150 mpirun -np "$np" python -m mpi4py -m hpcnet.bench allreduce --sizes 1MiB,25MiB,100MiB \
    --rounds 5 --json "$out/allreduce.json"
run bench-train 210 mpirun -np "$np" python -m mpi4py -m hpcnet.bench train --models resnet50 --batch-size 64 \
    --precision bf16 --rounds 4 --steps 5 --warmup 3 --json "$out/train.json"
run train-zero2 90 mpirun -np "$np" python -m mpi4py -m hpcnet.train train.steps=60 train.eval_every=0 \
    dist.zero=2 optim.name=adamw optim.lr=0.003 run.dir="$out/runs" checkpoint.dir="$out/ckpt-zero2" \
    checkpoint.move_aside=true
python - "$out" <<'EOF'
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])
print("\n=== summary (" + out.joinpath("devices.txt").read_text().splitlines()[0] + ")")
for line in out.joinpath("status.txt").read_text().split("\n"):
    if line:
        name, status, seconds = line.split()
        print(f"{name:12s} exit {status:>3s} in {seconds:>4s} s")
log = out.joinpath("train.log").read_text(errors="replace") if out.joinpath("train.log").exists() else ""
for pattern in (r"torch.distributed \w+: .*", r"gradients: .*", r"device settings \(cuda\.\*\): .*", r"done: .*"):
    found = re.search(pattern, log)
    print("  train:", found.group(0) if found else f"(no line matching {pattern!r})")
zlog = out.joinpath("train-zero2.log").read_text(errors="replace") if out.joinpath("train-zero2.log").exists() else ""
for pattern in (r"dist.zero=2 .*", r"done: .*"):
    found = re.search(pattern, zlog)
    print("  train-zero2:", found.group(0) if found else f"(no line matching {pattern!r})")
if out.joinpath("allreduce.json").exists():
    for row in json.loads(out.joinpath("allreduce.json").read_text())["results"]:
        print(f"  allreduce {row['size_bytes'] / 2**20:g} MiB busbw GB/s: " + ", ".join(
            f"{name} {m['busbw_GBps']['median']:.2f}" for name, m in row["methods"].items()))
if out.joinpath("train.json").exists():
    for model in json.loads(out.joinpath("train.json").read_text())["results"]:
        ratio = model["ratio_hpcnet_vs_ddp"]
        print(f"  bench train {model['name']} ({model['precision']}; {model['device_settings']}): " + ", ".join(
            f"{n} {v['samples_per_s']['median']:.0f}" for n, v in model["contenders"].items())
            + f" samples/s; hpcnet/DDP {ratio['median']:.3f} ({ratio['min']:.2f}-{ratio['max']:.2f})")
EOF
