#!/bin/sh
# Every GPU check in one prepared run (issue 16: "GPU rows measured whenever a GPU machine is
# lent", in one run that fits a 10-minute device slot). Run from the repository root on a
# machine with a CUDA GPU and PyTorch:
#
#   sh bench/device_checks.sh [OUT]
#   STEPS="pytest decoders" sh bench/device_checks.sh [OUT]   # some steps only
#
# Optional inputs beside the repository: .whl/*.whl (Python packages that machine lacks:
# lmdb, simplejpeg, zstandard, nvidia-nvimgcodec + nvidia-nvjpeg to measure nvImageCodec) and
# .dev/{include,lib} (libjpeg-turbo's headers and library, to build gpufeed-jpeg there).
# Each step is time-boxed and independent: one that fails is reported and the next runs.
# Results: OUT/summary.txt (the table printed last), OUT/*.json, OUT/*.log.
set -u
REPO=$(pwd)
OUT=${1:-${OUT:-/tmp/gpufeed-device}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=/tmp/gpufeed-site
SUMMARY="$OUT/summary.txt"
mkdir -p "$SITE"
: >"$SUMMARY"

STEPS=${STEPS:-smoke pytest decoders bench}
wanted() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

step() { # step NAME SECONDS COMMAND...: run, log to OUT/NAME.log, note the outcome
    name=$1 limit=$2
    shift 2
    wanted "${name%%-*}" || return 0
    start=$(date +%s)
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: rc=$rc in $(($(date +%s) - start)) s" | tee -a "$SUMMARY"
    tail -n 25 "$OUT/$name.log"
}

if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || echo "wheel install failed" | tee -a "$SUMMARY"
fi
export PYTHONPATH="$SITE:$REPO/app/src"
export PYTHONUNBUFFERED=1 GPUFEED_PREFLIGHT_QUIET=1
if [ -d .dev ]; then # gpufeed-jpeg as app/native/setup.py builds it, without setuptools
    export LD_LIBRARY_PATH="$REPO/.dev/lib:${LD_LIBRARY_PATH:-}"
    suffix=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    # shellcheck disable=SC2046 # pybind11 --includes is a list of flags
    timeout 240 c++ -O3 -shared -fPIC -fvisibility=hidden -std=c++17 \
        $($PY -m pybind11 --includes) -Iapp/native/src -I.dev/include app/native/src/*.cpp \
        -L.dev/lib -ljpeg -o "$SITE/gpufeed_jpeg$suffix" >"$OUT/native-build.log" 2>&1 ||
        echo "native build failed: see native-build.log" | tee -a "$SUMMARY"
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
    nproc
    $PY -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision",
torchvision.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
    $PY -c 'import gpufeed_jpeg; print("gpufeed_jpeg", gpufeed_jpeg.__file__)'
} 2>&1 | tee -a "$SUMMARY"

# 1. make smoke-gpu's script: preflight, CUDA, bf16, torch.compile, DevicePrefetcher, and
#    bench/studies/smoke_gpu.py (H2D, starvation, uint8 vs float, GPU JPEG decode rows)
step smoke 270 $PY tests/gpu/smoke.py --out "$OUT/smoke"
# 1b. (STEPS=feed) bench/studies/smoke_gpu.py alone: smoke's benchmark part without the other checks
step feed 150 $PY bench/studies/smoke_gpu.py --json "$OUT/feed.json"
# 2. the unit tests that take the CUDA branches (skipped on CPU-only machines and in CI)
step pytest 150 $PY -m pytest -q -p no:cacheprovider -o addopts= \
    tests/unit/loading/test_prefetch.py tests/unit/loading/test_device_decode.py \
    tests/unit/tools/test_bench.py
# 3. the decoders side by side: CPU native/opencv, torchvision nvJPEG, DeviceDecode, the crop
#    loop vs roi_align, nvImageCodec; pixels against the CPU and torchvision
step decoders 150 env LD_LIBRARY_PATH="$SITE/nvidia/nvjpeg/lib:${LD_LIBRARY_PATH:-}" \
    $PY bench/studies/gpu_decode.py --images 1024 --batch-size 256 --json "$OUT/gpu_decode.json"
# 4. gpufeed bench --device cuda --crop 224 on a JPEG pack: decoded on the GPU vs in workers
wanted bench && $PY - "$OUT/jpeg-pack" <<'EOF' >"$OUT/jpeg-pack.log" 2>&1
import sys
from pathlib import Path

sys.path.insert(0, ".")
from bench.studies import gpu_decode

import gpufeed

src = Path("/tmp/gpufeed-jpegs/c0")
src.mkdir(parents=True, exist_ok=True)
for i, b in enumerate(gpu_decode.make_jpegs(4096)):
    (src / f"{i:05d}.jpg").write_bytes(b)
gpufeed.pack(src.parent, sys.argv[1], format="mmap", workers=1, quiet=True)
EOF
for where in ${BENCH_DECODE:-cuda cpu}; do
    step "bench-$where" 60 $PY -m gpufeed bench "$OUT/jpeg-pack" --device cuda --crop 224 \
        --decode-on "$where" --seconds 8 --step-ms 20 -b 256
done
rm -rf "$OUT/jpeg-pack"

echo
echo "== summary"
cat "$SUMMARY"
for f in "$OUT/smoke/smoke-gpu.md" "$OUT/decoders.log"; do
    [ -f "$f" ] && tail -n 40 "$f"
done
grep -h -E "^(samples/s|decode|starvation|data wait|first batch)" "$OUT"/bench-*.log 2>/dev/null
exit 0
