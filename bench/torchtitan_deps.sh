#!/usr/bin/env bash
# torchtitan for bench/gpu_table.py's torchtitan rows, kept out of hydratrain's environment: torchtitan 0.3.0 and the
# pure-Python packages it imports that neither hydratrain's environment nor the GPU machine's image has (each pinned
# to the version checked; torch, numpy, safetensors, tokenizers, tensorboard, einops and pillow come from the
# environment; triton and Hugging Face datasets, which a dense Llama on synthetic tokens never calls, are stood in
# for where absent: bench/torchtitan_worker.py).
#
#   bash bench/torchtitan_deps.sh wheels [DIR]            # download the wheels into DIR (default bench/wheels), to
#                                                         #   carry to a machine without internet (about 6 MB)
#   bash bench/torchtitan_deps.sh install DIR [WHEELS]    # unpack them into DIR (pip --target, no dependencies):
#                                                         #   from WHEELS if given, else from the package registry
#   TORCHTITAN_SITE=DIR python bench/gpu_table.py --rows torchtitan
#
# bench/gpu.sh runs the install itself when bench/wheels holds the wheels and TORCHTITAN_SITE is unset.
set -euo pipefail

PY="${PYTHON:-python}"
PACKAGES=(torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 shtab==1.13.0 spmd_types==0.2.3
          torchdata==0.11.0 torch_checkpointing==0.1.1)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

case "${1:-}" in
  wheels)
    DIR="${2:-$ROOT/bench/wheels}"
    mkdir -p "$DIR"
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR" "${PACKAGES[@]}"
    echo "bench/torchtitan_deps.sh: $(ls "$DIR"/*.whl | wc -l) wheels in $DIR ($(du -sh "$DIR" | cut -f1))"
    ;;
  install)
    DIR="${2:?install needs a target directory}"
    if [[ -n "${3:-}" ]]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$DIR" "$3"/*.whl
    else
      "$PY" -m pip install -q --no-deps --no-compile --upgrade --target "$DIR" "${PACKAGES[@]}"
    fi
    echo "bench/torchtitan_deps.sh: torchtitan in $DIR (TORCHTITAN_SITE=$DIR)"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]] && exit 0
    exit 2
    ;;
esac
