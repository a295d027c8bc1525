"""Runs torchdata's own StatefulDataLoader resume tests twice: with torchdata's StatefulDataLoader, and with
torchforge.DataLoader swapped in for it (every process, spawned ones too), and prints the counts.

The tests come from a checkout of https://github.com/pytorch/data (never copied into the project), whose
``torchdata`` package is imported from the checkout: pass its folder with ``--torchdata``. Needs
``expecttest`` and ``parameterized`` (the test extra). Tests that read StatefulDataLoader's private state
keys (``_snapshot``, ``dataset_state``, ...) fail with a KeyError against any other loader; they are
listed apart.

Run: ``.venv/bin/python tests/compat/run_torchdata_tests.py --torchdata PATH [-k EXPR]``
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FILES = ("test/stateful_dataloader/test_state_dict.py", "test/stateful_dataloader/test_sampler.py")


def run(checkout: str, swap: bool, extra: list[str]) -> dict[str, tuple[str, str]]:
    """test -> (outcome, the first line of its failure)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "swap"), ROOT, checkout, env.get("PYTHONPATH", "")])
    env["TORCHFORGE_SWAP"] = "torchdata" if swap else "0"
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "report.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", tmp, "-o", "addopts=",
               "--timeout", "120", f"--junitxml={xml}", *(os.path.join(checkout, f) for f in FILES), *extra]
        subprocess.run(cmd, env=env, cwd=tmp, check=False)
        out = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            bad = next((c for c in case if c.tag in ("failure", "error")), None)
            outcome = "failed" if bad is not None else "skipped" if any(c.tag == "skipped" for c in case) else "passed"
            first = (bad.get("message") or " ").strip().splitlines()[0].split("\\n")[0] if bad is not None else ""
            out[name] = (outcome, first[:120])
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torchdata", required=True, help="a checkout of github.com/pytorch/data")
    p.add_argument("-k", default=None, help="pytest -k expression, to run a subset")
    args = p.parse_args()
    extra = ["-k", args.k] if args.k else []
    theirs = run(args.torchdata, False, extra)
    ours = run(args.torchdata, True, extra)
    passing = sorted(t for t, (o, _) in theirs.items() if o == "passed")
    failed = [t for t in passing if ours.get(t, ("missing", ""))[0] != "passed"]
    private = [t for t in failed if ours[t][1].startswith("KeyError")]
    print(f"\ntorchdata's StatefulDataLoader: {len(passing)} of {len(theirs)} passed")
    print(f"torchforge.DataLoader swapped in: {len(passing) - len(failed)} of {len(passing)} passed; of the "
          f"{len(failed)} others, {len(private)} read StatefulDataLoader's private state keys (KeyError)")
    for t in failed:
        print(f"  {'private key' if t in private else 'failed':11s} {t}: {ours.get(t, ('missing', ''))[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
