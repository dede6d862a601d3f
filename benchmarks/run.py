"""The benchmark runner from a checkout: `python benchmarks/run.py --suite NAME ...` is
`python -m fivar.bench --suite NAME ...` (see benchmarks/README.md)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fivar.bench.runner import main  # noqa: E402

sys.exit(main())
