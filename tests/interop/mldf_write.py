"""Write rich(n, seed, tensors) samples with MLDataForge's JinxDatasetWriter (Python 3.12 venv).

    python mldf_write.py JOBS_JSON

JOBS_JSON is a list of [folder, n, seed, tensors, options]; options are JinxDatasetWriter keyword
arguments (shard_size, compression, encoding, ...).
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fixtures", "interop"))
import lz4.frame  # noqa: F401  MLDataForge uses lz4.frame after a bare `import lz4`
from expected import rich
from mldataforge.jinx import JinxDatasetWriter


def main(jobs):
    for folder, n, seed, tensors, options in jobs:
        with JinxDatasetWriter(folder, **options) as w:
            for s in rich(n, seed, tensors):
                w.write(s)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
