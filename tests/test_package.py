"""The public API: lazy exports resolve, and importing torchforge stays cheap."""
import subprocess
import sys

import torchforge


def test_every_export_resolves_and_all_is_sorted():
    assert torchforge.__all__ == sorted(set(torchforge.__all__))
    for name in torchforge.__all__:
        assert getattr(torchforge, name) is not None, name
        assert name in dir(torchforge), name


def test_import_is_lazy():
    code = ("import sys, torchforge; "
            "print(sorted(m for m in ('torch', 'streaming', 'torchforge.loader') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
