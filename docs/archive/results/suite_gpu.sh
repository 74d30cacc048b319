#!/usr/bin/env bash
# A LIBERO suite profile on a GPU machine whose calls carry at most 64 MiB each, working tree included: the LIBERO
# bundle (infra/libero_bundle.py, ~71 MB with PyAV) travels in three parts, then the stages run detached under
# /tmp/snap (a copy of the code, so that later calls do not disturb them) and hand their outputs back in parts.
#
#   here:   bash docs/archive/results/suite_gpu.sh pack SUITE     # build the bundle, split into .gb1 .gb2 .gb3 (+ .gl)
#   there:  call 1, carry [.gl, .gb1]:  bash .gb1/suite_gpu.sh prep
#           call 2, carry [.gb2]:       bash /tmp/suite_gpu.sh parts .gb2
#           call 3, carry [.gb3]:       bash /tmp/suite_gpu.sh parts .gb3 && bash /tmp/suite_gpu.sh setup
#           then                        bash /tmp/suite_gpu.sh run "STAGES" [--set K=V ..]   (detached; resumes)
#                                       bash /tmp/suite_gpu.sh wait SECONDS
#                                       bash /tmp/suite_gpu.sh handover FIRST LAST   (parts FIRST..LAST into $OUT)
#                                       bash /tmp/suite_gpu.sh collect               (small files into $OUT)
#                                       bash /tmp/suite_gpu.sh prof                  (recording_profile.py)
# PROFILE (default libero_goal) names the profile; the stage timings are runs/profile_$PROFILE.jsonl.
set -uo pipefail
S=/tmp/snap
P=${PROFILE:-libero_goal}
AV=av-15.1.0-cp312-cp312-manylinux_2_28_x86_64.whl
export PYTHONPATH=/tmp/libero/site:$S LIBERO_CONFIG_PATH=/tmp/libero/config MUJOCO_GL=egl
case "${1:-}" in
  pack)
    suite=${2:?suite}
    MUJOCO_GL=egl LIBERO_CONFIG_PATH=$PWD/.venv/libero_config .venv/bin/python infra/libero_bundle.py --suite "$suite" \
      --tasks 0-9 --python 3.12 --extra-wheel av==15.1.0 --out /tmp/gb/.libero_bundle || exit 1
    rm -rf .gb1 .gb2 .gb3 && mkdir -p .gb1 .gb2 .gb3
    for d in .gb1 .gb2 .gb3 .gl; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
    cp /tmp/gb/.libero_bundle/{install.sh,site.tar.xz} docs/archive/results/suite_gpu.sh \
      docs/archive/results/recording_profile.py .gb1/
    split -b 20M /tmp/gb/.libero_bundle/wheels/$AV .gb2/avpart.
    mv .gb2/avpart.ab .gb3/ && cp /tmp/gb/.libero_bundle/wheels/{mujoco,cffi}-*.whl .gb2/
    if [[ ! -d .gl ]]; then
      mkdir -p .gl /tmp/amd64/partial; o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
      apt-get $o update >/dev/null && (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
    fi
    du -sh .gb1 .gb2 .gb3 .gl ;;
  prep)
    for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
    mkdir -p $S/docs/archive/results $S/.libero_bundle/wheels /tmp/parts
    cp -a dzmodel flows tasks infra params.yaml dvc.yaml prefect.yaml pyproject.toml README.md Makefile $S/
    cp docs/archive/results/profile_gpu.sh docs/archive/results/libero_scripted_gpu.sh $S/docs/archive/results/
    cp .gb1/install.sh .gb1/site.tar.xz $S/.libero_bundle/ && cp .gb1/suite_gpu.sh .gb1/recording_profile.py /tmp/
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc ;;
  parts)
    cp -v "${2:?folder}"/* /tmp/parts/ ;;
  setup)
    cd /tmp/parts && cat avpart.a? > $S/.libero_bundle/wheels/$AV && cp ./*.whl $S/.libero_bundle/wheels/
    cd $S && bash docs/archive/results/libero_scripted_gpu.sh setup || exit 1
    timeout 60 python3 -c 'from mujoco.egl import GLContext; c = GLContext(64, 64); c.make_current()
from OpenGL import GL; print("GL:", GL.glGetString(GL.GL_VENDOR), GL.glGetString(GL.GL_RENDERER))' 2>&1 | grep GL: ;;
  run)
    stages=${2:?stages}; shift 2
    cd $S && mkdir -p runs && (pgrep -f "nvidia-smi --query" >/dev/null || (nvidia-smi --query-gpu=utilization.gpu,memory.used \
      --format=csv -l 10 > runs/gpu_util.csv 2>&1 &))
    PROFILE=$P STAGES="$stages" bash docs/archive/results/profile_gpu.sh "$@" ;;
  wait)
    cd $S && PROFILE=$P bash docs/archive/results/profile_gpu.sh wait "${2:-560}"
    tail -n 3 runs/gpu_util.csv 2>/dev/null; top -bn1 | sed -n 7,14p ;;
  handover)
    cd $S && [[ -e /tmp/handover.tar.part-aa ]] || { tar -cf - "data/$P" "runs/$P/vision" "runs/$P/metadata" \
      runs/profile_$P.* runs/gpu_util.csv 2>/dev/null | split -b 15M - /tmp/handover.tar.part-; }
    ls -la /tmp/handover.tar.part-*
    for f in $(ls /tmp/handover.tar.part-* | sed -n "${2:-1},${3:-4}p"); do cp "$f" "$OUT/"; done; ls -la "$OUT" ;;
  collect)
    cd $S && find "runs/$P" "metrics/$P" "data/$P" runs/profile_$P.* runs/gpu_util.csv -type f -size -3M \
      ! -name '*.safetensors' ! -name '*.pt' ! -name '*.mp4' ! -name '*.parquet' 2>/dev/null | tar -czf "$OUT/$P.tar.gz" -T -
    ls -la "$OUT" ;;
  prof)
    cd $S && python3 /tmp/recording_profile.py single 2>&1 | grep -v "Exception ignored\|Traceback\|OpenGL\|egl_context\|binding_utils"
    for n in 1 8 16 24; do python3 /tmp/recording_profile.py multi "$n" 2>&1 | grep procs; done ;;
  *)
    echo "usage: suite_gpu.sh pack SUITE | prep | parts DIR | setup | run STAGES [--set K=V ..] | wait SECONDS |" \
      "handover FIRST LAST | collect | prof" >&2
    exit 2 ;;
esac
