"""The quickstart notebook executes top to bottom, so it cannot rot."""
import os

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is in the test extra")
nbclient = pytest.importorskip("nbclient", reason="nbclient is in the test extra")

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "notebooks", "quickstart.ipynb")


def test_quickstart_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert len(nb.cells) >= 8
    # "python3" is ipykernel's native kernel: this interpreter, i.e. the project's venv.
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert "restored weights identical: True" in outputs
    assert "every index exactly once across ranks: True" in outputs
