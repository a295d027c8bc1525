"""Read JINX folders with MLDataForge's JinxDatasetReader and print one JSON line per folder.

Run by tests/test_jinx_mldataforge.py inside the Python 3.12 venv made by setup_mldataforge.sh:
    python mldf_read.py FOLDER [FOLDER ...]
Each output line: {"path": ..., "lazy": [...canonical samples...], "eager": [...], "iter": [...]},
or {"path": ..., "error": "..."} when MLDataForge fails on the folder.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lz4.frame  # noqa: F401  MLDataForge uses lz4.frame after a bare `import lz4`; a full install imports it elsewhere
from canon import canon
from mldataforge.jinx import JinxDatasetReader


def main(folders):
    for folder in folders:
        out = {"path": folder}
        try:
            read(folder, out)
        except Exception as e:  # noqa: BLE001 - reported, so the test can name what MLDataForge refused
            out["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(out), flush=True)


def read(folder, out):
    # No close(): MLDataForge 0.6.10's close() fails on its own np.memmap index.
    r = JinxDatasetReader(folder, lazy=True, mmap=True)
    out["lazy"] = [canon(r[i].materialize()) for i in range(len(r))]
    r = JinxDatasetReader(folder, lazy=False, mmap=False)
    out["eager"] = [canon(r[i]) for i in range(len(r))]
    out["iter"] = [canon(s) for s in r]


if __name__ == "__main__":
    main(sys.argv[1:])
