"""A non-editable install ships only the packages pyproject.toml lists; a forgotten subpackage works
in the editable dev install and breaks on the GPU machine. Check the list against the tree."""
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "minillm").rglob("__init__.py")
    }
    assert on_disk, "found no package under minillm/"
    assert on_disk <= listed, f"missing from pyproject packages: {sorted(on_disk - listed)}"
    assert config["package-dir"]["minillm.kernels"] == "kernels"
    kernels = {
        ".".join(("minillm",) + init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "kernels").rglob("__init__.py")
    }
    assert "minillm.kernels" in kernels, "found no kernels/__init__.py"
    assert kernels <= listed, f"missing from pyproject packages: {sorted(kernels - listed)}"
