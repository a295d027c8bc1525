#!/usr/bin/env bash
# Build the Python 3.12 virtualenv in which MLDataForge 0.6.10 reads torchforge's JINX output
# (tests/test_jinx_mldataforge.py) and the benchmark benchmarks/jinx_vs_mldataforge.py runs.
#
# MLDataForge needs Python >= 3.12. Its jinx modules import torch, orjson, numpy and (through
# mldataforge.compression) click, isal, lz4, brotli, python-snappy and zstandard at import time, but not
# `datasets` or `mosaicml-streaming`: those are left out (--no-deps). msgspec is torchforge's (its fast JINX
# line parser). torch from PyPI is the large CUDA build (a few GB), so this is a separate, optional step;
# the interop test skips when the venv is absent.
#
# Usage: tests/interop/setup_mldataforge.sh [VENV_DIR]   (default: .venv-mldf in the repo root)
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
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q --no-deps mldataforge==0.6.10
"$venv/bin/python" -m pip install -q orjson msgspec numpy zstandard click isal lz4 brotli python-snappy "torch==2.14.1"
"$venv/bin/python" -c "from mldataforge.jinx import JinxDatasetReader, JinxDatasetWriter"
touch "$venv/.mldf-ok"
echo "setup_mldataforge: $venv is ready"
