"""`python benchmarks/bench_compile.py ...` is `python -m fivar.bench.compile_time ...` (build and cache costs;
kept only while `fivar bench NAME --compile` still calls this path)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivar.bench.compile_time import main  # noqa: E402

sys.exit(main())
