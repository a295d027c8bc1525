#!/usr/bin/env bash
# Build the Python 3.12 virtualenv in which MLDataForge 0.6.10 reads torchforge's JINX output
# (tests/test_jinx_mldataforge.py) and the benchmark benchmarks/jinx_vs_mldataforge.py runs.
#
# MLDataForge needs Python >= 3.12. Its jinx modules import torch, orjson, numpy and (through
# mldataforge.compression) click, isal, lz4, brotli, python-snappy and zstandard at import time, but not
# `datasets` or `mosaicml-streaming`: those are left out (--no-deps). msgspec is torchforge's (its fast JINX
# line parser). torch from PyPI is the CUDA build: its CUDA libraries (the nvidia-* wheels, 3.2 GB) are
# the dev venv's, linked, when it has them (the same torch pin needs the same ones), and triton (0.9 GB,
# imported only by torch.compile) is left out, so this venv takes 1.4 GB instead of 5.5 GB. A CI disk
# filled up installing a second copy. Without a dev venv, torch is installed whole. This is an optional
# step: the interop test skips when the venv is absent.
#
# Usage: tests/interop/setup_mldataforge.sh [VENV_DIR]   (default: .venv-mldf in the repo root;
#        TORCHFORGE_VENV names the dev venv whose CUDA libraries are shared, default .venv)
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-$here/.venv-mldf}"
py="${PYTHON312:-}"
if [ -z "$py" ]; then
  for cand in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
    if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      py="$cand"; break
    fi
  done
fi
if [ -z "$py" ]; then echo "setup_mldataforge: no python3.12 found (set PYTHON312)" >&2; exit 1; fi
if [ -f "$venv/.mldf-ok" ]; then echo "setup_mldataforge: $venv is ready"; exit 0; fi
# Room first: filling the disk here would fail every test after it (the interop tests only skip).
need_mb="${MLDF_NEED_MB:-4000}"
free_mb="$(df -Pm "$(dirname "$venv")" | awk 'NR == 2 {print $4}')"
if [ -n "$free_mb" ] && [ "$free_mb" -lt "$need_mb" ]; then
  echo "setup_mldataforge: only ${free_mb} MB free beside $venv, ${need_mb} MB wanted: not building it" >&2
  exit 1
fi
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q --no-deps mldataforge==0.6.10
"$venv/bin/python" -m pip install -q orjson msgspec numpy zstandard click isal lz4 brotli python-snappy
dev="${TORCHFORGE_VENV:-$here/.venv}"
cuda=""
if [ -x "$dev/bin/python" ]; then
  cuda="$("$dev/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia"
fi
if [ -n "$cuda" ] && [ -d "$cuda" ]; then
  # torch's own pure-Python requirements, then torch without its CUDA wheels and triton
  "$venv/bin/python" -m pip install -q filelock fsspec jinja2 networkx sympy typing-extensions setuptools
  "$venv/bin/python" -m pip install -q --no-deps "torch==2.14.1"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  rm -rf "$site/nvidia"
  ln -s "$(realpath --relative-to="$site" "$cuda")" "$site/nvidia"
else
  "$venv/bin/python" -m pip install -q "torch==2.14.1"
fi
"$venv/bin/python" -c "from mldataforge.jinx import JinxDatasetReader, JinxDatasetWriter"
touch "$venv/.mldf-ok"
echo "setup_mldataforge: $venv is ready"
