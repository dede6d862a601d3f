"""benchmarks/tools/gpu_suite.py's plan: every selected GPU test in exactly one process, shards contiguous and in order,
a file whose tests did not collect run whole (so its error shows), -k passed to every process."""
import importlib.util
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "tools" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shards_hold_every_test_once_in_order(monkeypatch):
    suite, rng = _suite(), random.Random()
    counts = {"kernels": rng.randint(50, 400), "tables": rng.randint(1, 60), "broken": 0}
    ids = {s: [f"tests/test_gpu_{s}.py::t[{i}]" for i in range(n)] for s, n in counts.items()}
    seen = []
    monkeypatch.setattr(suite, "collect", lambda stems, env, keyword: seen.append((stems, keyword)) or
                        {s: ids[s] for s in stems})
    shards = rng.randint(2, 9)
    for max_tests in (None, rng.randint(5, 40)):
        jobs = suite.plan_jobs([f"kernels:{shards}", "tables", "broken:3"], {}, max_tests, ["-k", "fa2"])
        assert seen[-1] == (["kernels", "tables", "broken"] if max_tests else ["kernels", "broken"], ["-k", "fa2"])
        by_file = {}
        for name, targets in jobs:
            stem = name.partition(".")[0]
            by_file.setdefault(stem, []).append(targets)
        assert by_file["kernels"] and [t for part in by_file["kernels"] for t in part] == ids["kernels"]
        assert len(by_file["kernels"]) == min(shards, counts["kernels"]) and all(by_file["kernels"])
        assert by_file["broken"] == [["-k", "fa2", "tests/test_gpu_broken.py"]]  # whole: its collection error shows
        if max_tests and counts["tables"] > max_tests:  # as many shards as keep each within max_tests
            tables = [t for part in by_file["tables"] for t in part]
            assert tables == ids["tables"] and all(len(part) <= max_tests for part in by_file["tables"])
        else:
            assert by_file["tables"] == [["-k", "fa2", "tests/test_gpu_tables.py"]]
