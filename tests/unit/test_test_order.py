"""The order tests/conftest.py hands test files out in (pytest-xdist keeps it: pyproject's --no-loadscope-reorder):
the files that run nvcc first, then the longest first by each file's last recorded seconds (measured figures for a
file with no record), each file's tests together and in their own order."""
import random
import tomllib
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _conftest(config):
    return next(p for p in config.pluginmanager.get_plugins()
                if getattr(p, "__file__", "").endswith(str(Path("tests", "conftest.py"))))


def _items(files: dict[str, int], nvcc: set[str]):
    """Fake collected items: `files[name]` tests per file, in file order, the nvcc ones marked."""
    out = []
    for name, n in files.items():
        for i in range(n):
            out.append(types.SimpleNamespace(path=REPO / "tests" / "unit" / name, name=f"{name}::t{i}",
                                             keywords={"nvcc": True} if name in nvcc else {},
                                             add_marker=lambda m: None))
    return out


def test_nvcc_files_then_the_longest_first_each_file_whole(request):
    conftest = _conftest(request.config)
    rng = random.Random()
    names = [f"test_f{i}.py" for i in range(8)] + ["test_distributed.py"]
    rng.shuffle(names)
    files = {n: rng.randint(1, 5) for n in names}
    nvcc = set(rng.sample(names, 2))
    seconds = {f"tests/unit/{n}": rng.uniform(0, 100) for n in names if n != "test_distributed.py"}
    cache = types.SimpleNamespace(get=lambda key, default: {conftest._FILE_SECONDS: seconds}.get(key, default))
    items = _items(files, nvcc)
    conftest.pytest_collection_modifyitems(types.SimpleNamespace(cache=cache), items)
    order = list(dict.fromkeys(it.path.name for it in items))
    assert len(order) == len(files)  # each file's tests together
    for n in files:  # and in their own order
        got = [it.name for it in items if it.path.name == n]
        assert got == [f"{n}::t{i}" for i in range(files[n])]

    def cost(n):  # a file with no record: its measured figure
        return seconds.get(f"tests/unit/{n}", conftest._MEASURED.get(n, 0))
    want = sorted(files, key=lambda n: (n not in nvcc, -cost(n)))
    assert order == want


def test_xdist_keeps_the_order():
    addopts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "--dist loadfile" in addopts and "--no-loadscope-reorder" in addopts
