#!/usr/bin/env bash
# What to run on a GPU machine with pydisc installed (IREE's wheels and torch with CUDA):
#   scripts/gpu_check.sh OUTDIR [NAME ...]
# NAMEs (default: all, about 20 minutes): cuda_tests bench_direct torch_mlir_route long_run mnist bert_mlm
# gpt_char resnet inference mnist_iree bert_mlm_iree. Each runs with a time limit, its log in OUTDIR/NAME.log, a line in
# OUTDIR/summary.txt. The examples train eager and pydisc side by side on CUDA; the *_iree ones repeat
# them with PYDISC_GPU_EXECUTOR=iree (IREE's runtime instead of pydisc's direct kernel launch).
set -u
out=${1:-gpu-logs}
shift || true
names=${*:-cuda_tests bench_direct torch_mlir_route long_run mnist bert_mlm gpt_char resnet inference mnist_iree bert_mlm_iree}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L > "$out/gpu.txt" 2>&1
run() {  # run NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
}
for name in $names; do
    case $name in
        cuda_tests) run cuda_tests 200 python -m pytest -q -p no:logging --tb=short -m cuda tests ;;
        bench_direct) run bench_direct 90 python bench/direct_launch.py --repeats 200 ;;
        torch_mlir_route) run torch_mlir_route 150 python -m pytest -q -p no:logging --tb=short tests/exec/test_torch_mlir_route.py ;;
        long_run) run long_run 240 python scripts/long_run.py --device cuda ;;
        mnist) run mnist 120 python examples/mnist.py --device cuda ;;
        bert_mlm) run bert_mlm 150 python examples/bert_mlm.py --device cuda ;;
        gpt_char) run gpt_char 150 python examples/gpt_char.py --device cuda ;;
        resnet) run resnet 150 python examples/resnet.py --device cuda ;;
        inference) run inference 60 python examples/inference.py --device cuda ;;
        mnist_iree) PYDISC_GPU_EXECUTOR=iree run mnist_iree 120 python examples/mnist.py --device cuda ;;
        bert_mlm_iree) PYDISC_GPU_EXECUTOR=iree run bert_mlm_iree 150 python examples/bert_mlm.py --device cuda ;;
        *) echo "unknown: $name" | tee -a "$out/summary.txt" ;;
    esac
done
