"""python -m fivar.bench --suite NAME [--suite NAME2] [--case FILTER] [--rounds N] [--quick] [--results DIR]"""
import sys

from .runner import main

sys.exit(main())
