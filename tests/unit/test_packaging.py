"""A wheel (non-editable install) carries every template, header and bundled variant a module is made from."""
import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[2]


def test_package_data_covers_every_template_header_and_variant():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, folder in cfg["package-dir"].items():
        patterns = cfg["package-data"][package]
        root = REPO / folder
        files = [p.relative_to(root).as_posix() for p in root.rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts and p.name != "__init__.py"]
        assert files, folder
        missing = [f for f in files if not any(fnmatch.fnmatch(f, pat) and f.count("/") == pat.count("/")
                                               for pat in patterns)]
        assert not missing, f"{folder}/: {missing} would be left out of a wheel (pyproject package-data)"
