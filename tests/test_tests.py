"""The test suite's own conventions (STYLE.md): shared helpers live in conftest.py as fixtures, modules
the tests import by name come from pytest's ``pythonpath`` setting, never from ``sys.path`` edits."""
import ast
import glob
import os

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_FILES = sorted(glob.glob(os.path.join(HERE, "test_*.py")))


def _tree(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def test_no_test_file_edits_sys_path():
    edits = []
    for path in TEST_FILES:
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                edits.append(f"{os.path.basename(path)}:{node.lineno}")
    assert edits == [], f"sys.path used in {edits}: add the folder to pythonpath in pyproject.toml"


def test_no_helper_is_copied_between_test_files():
    where: dict[str, list[str]] = {}
    for path in TEST_FILES:
        for node in _tree(path).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("test_"):
                body = ast.dump(ast.Module(body=node.body, type_ignores=[]))  # any name, same code
                where.setdefault(body, []).append(f"{os.path.basename(path)}:{node.name}")
    copies = [defs for defs in where.values() if len({d.split(":")[0] for d in defs}) > 1]
    assert copies == [], f"helpers copied between test files (move them to conftest.py): {copies}"
