#!/usr/bin/env bash
# One call on a lent NVIDIA GPU (the device tool's `run`): the GPU tests and benchmarks/gpu.py
# together, logs and JSON under $OUT. The tests run first on the CPU cores while the two
# benchmark processes compile; each benchmark times only once the job before it is done, so
# no timing shares the machine with other work.
#
#   bash benchmarks/gpu_session.sh            (environment: TESTS, TEST_TIMEOUT, BENCH_TIMEOUT,
#                                              MODELS, BATCHES, SKIP, PYTEST_K)
#
# The device image lacks cryptography (kiln's artifact signing); carry it as wheels in an
# ignored .whl/ folder (run's carry=[".whl"]), fetched beforehand on the development machine:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl cryptography cffi pycparser
# A first call that fits a 15-minute device budget with time to rerun (~7 minutes):
#   TEST_TIMEOUT=330 BENCH_TIMEOUT=400 PYTEST_K="not o3 and not bf16 and not tf32" bash benchmarks/gpu_session.sh
# (on an H100 on 11-28 that call took 201 s of command time, plus about 30 s to start). MODELS=" "
# runs the tests alone; SKIP=kiln-bf16,torch.compile adds the kiln-O3 row (one more build per
# model). Keep autotuning out of a call that also runs the tests: a max-autotune build beside
# them took the call past its time (41.6 s for one matmul shape's 21 Triton choices).
set -u
OUT=${OUT:-/tmp/kiln-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then     # packages the image lacks (cryptography), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# kiln's entry points (torch.compile(backend="kiln")) as an installed kiln would have them
mkdir -p /tmp/site/kiln_source-0.dist-info
printf 'Metadata-Version: 2.1\nName: kiln-source\nVersion: 0\n' >/tmp/site/kiln_source-0.dist-info/METADATA
printf '[torch_dynamo_backends]\nkiln = kiln.device.compile_backend:backend\n' \
  >/tmp/site/kiln_source-0.dist-info/entry_points.txt
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the image's AOTInductor CUDA packages crash in std::regex at load without the system libstdc++
export LD_PRELOAD="$(readlink -f "$(g++ -print-file-name=libstdc++.so.6)")"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
rm -f "$OUT"/*.done
(
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider --timeout=300 -rfEs \
    ${TESTS:-tests/test_device_cuda.py} -k "${PYTEST_K:-not o3}" >"$OUT/tests.log" 2>&1
  echo "pytest rc=$?" >>"$OUT/tests.log"
  touch "$OUT/tests.done"
) &
prev="$OUT/tests.done"
for model in ${MODELS:-bert-base resnet50}; do
  (
    timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/gpu.py --models "$model" --batches "${BATCHES:-1}" \
      --rounds 3 --skip "${SKIP:-kiln-bf16,kiln-O3,torch.compile}" --after "$prev" --json "$OUT/gpu-$model.json" >"$OUT/bench-$model.log" 2>&1
    echo "gpu.py rc=$?" >>"$OUT/bench-$model.log"
    touch "$OUT/$model.done"
  ) &
  prev="$OUT/$model.done"
done
wait
echo "=== tests"; grep -E "passed|failed|error|Error|FAILED|rc=" "$OUT/tests.log" | tail -40
for model in ${MODELS:-bert-base resnet50}; do echo "=== $model"; tail -15 "$OUT/bench-$model.log"; done
