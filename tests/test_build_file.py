"""BUILD and pyproject.toml keep up with the tree: every module and test listed, nothing stale.

Starlark calls parse as Python, so BUILD is read with ``ast``; ``srcs`` must be literal lists.
"""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("glmjax", "pallas_kernels", "serving", "bench")


def build_targets():
    """``{name: (rule, srcs)}`` for every ``py_library`` and ``py_test`` call in BUILD."""
    tree = ast.parse((ROOT / "BUILD").read_text(), filename="BUILD")
    targets = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("py_library", "py_test"):
            continue
        kwargs = {keyword.arg: keyword.value for keyword in node.keywords}
        name = ast.literal_eval(kwargs["name"])
        srcs = ast.literal_eval(kwargs["srcs"]) if "srcs" in kwargs else []
        targets[name] = (node.func.id, srcs)
    return targets


def package_modules(package):
    """Every .py file under ``package``, as repo-relative POSIX paths."""
    return {path.relative_to(ROOT).as_posix() for path in (ROOT / package).rglob("*.py")}


def test_every_package_module_is_in_its_library():
    targets = build_targets()
    for package in PACKAGES:
        rule, srcs = targets.get(package, (None, []))
        assert rule == "py_library", f"BUILD has no py_library named {package!r}"
        missing = sorted(package_modules(package) - set(srcs))
        assert not missing, f"BUILD: py_library {package!r} does not list {missing}"


def test_every_test_file_has_a_py_test():
    targets = build_targets()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        rule, srcs = targets.get(path.stem, (None, []))
        assert rule == "py_test" and rel in srcs, f"BUILD: no py_test {path.stem!r} for {rel}"


def test_listed_files_exist():
    stale = sorted(
        f"{src} (in {name!r})"
        for name, (_, srcs) in build_targets().items()
        for src in srcs
        if not (ROOT / src).is_file()
    )
    assert not stale, f"BUILD lists files that do not exist: {stale}"


def test_pyproject_lists_every_package():
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = {
        init.parent.relative_to(ROOT).as_posix().replace("/", ".")
        for package in PACKAGES
        for init in (ROOT / package).rglob("__init__.py")
    }
    missing = sorted(found - set(listed))
    assert not missing, f"pyproject.toml [tool.setuptools] packages does not list {missing}"
