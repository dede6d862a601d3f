"""benchmarks/tools/hostile.py, the hostile-user battery behind docs/reliability.md's figures, run at a fresh seed
with a few attempts per class (a process of its own: it points FlashInfer's and fivar's caches at a temporary
directory before importing them): no traceback, no silent wrong result, every class attempted."""
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_few_seeded_attempts_per_class_give_no_traceback_and_no_wrong_result(tmp_path):
    seed = random.randrange(10**6)
    out = tmp_path / "hostile.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tools" / "hostile.py"), "--attempts", "3",
                        "--seed", str(seed), "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"seed {seed}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    res = json.loads(out.read_text())
    assert res["bad"] == [] and len(res["counts"]) == 9, res
    for name, c in res["counts"].items():
        assert sum(c.values()) == 3 and c["traceback"] == c["wrong"] == 0, (name, c)
    assert "| all | 27 |" in r.stdout, r.stdout
