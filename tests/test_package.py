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


def test_the_subpackages_the_docs_name_are_attributes_after_import_torchforge():
    code = ("import torchforge\n"
            "for name in ('features', 'remote', 'cache', 'lazy', 'sizes', 'streaming', 'checkpoint'):\n"
            "    assert getattr(torchforge, name).__name__ == 'torchforge.' + name, name\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.strip() == "ok", out.stderr[-1500:]


def test_open_dataset_checks_the_mode_of_a_file_url(tmp_path):
    import pytest

    import torchforge

    with torchforge.JinxWriter(tmp_path / "j") as w:
        w.write({"id": 1})
    assert len(torchforge.open_dataset(f"file://{tmp_path}/j", mode="ranges")) == 1  # (read in place)
    with pytest.raises(ValueError, match="mode='whole' must be 'shards' or 'ranges'"):
        torchforge.open_dataset(f"file://{tmp_path}/j", mode="whole")


def test_the_dataset_classes_show_their_own_arguments_not_their_dispatching_new():
    """help(MDSDataset) and inspect.signature showed (*args, **kwargs): the defaults, which differ between
    the classes (lazy=True for JINX, lazy=False and zero_copy=True for MDS), were nowhere to be seen."""
    import inspect

    from torchforge.datasets.remote import RemoteMDSDataset

    mds = inspect.signature(torchforge.MDSDataset).parameters
    assert mds["lazy"].default is False and mds["zero_copy"].default is True and "self" not in mds
    assert inspect.signature(torchforge.JinxDataset).parameters["lazy"].default is True
    assert "columns" in inspect.signature(torchforge.SafetensorsDataset).parameters
    assert "cache_dir" in inspect.signature(RemoteMDSDataset).parameters  # its own, not MDSDataset's
