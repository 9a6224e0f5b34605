"""The core benchmark: `python scripts/bench_core.py [--json PATH] ...`.

Same as `python -m remat_dist bench`; kept as a script so docs can point at a file.
"""

import sys

from remat_dist.cli.bench import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
