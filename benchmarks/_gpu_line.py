"""One summary line of a GPU ``benchmarks.core`` JSON (used by scripts/gpu_check.sh):
``python -m benchmarks._gpu_line BENCH_JSON``."""

import json
import sys

rows = {(r["dim"], r["variant"]): r for r in json.load(open(sys.argv[1]))["rows"]}
r, t = rows[(512, "remat_dist full")], rows[(512, "torch.utils.checkpoint")]
print(
    f"D512 full: x torch {r['x_torch']:.3f}, peak {r['peak_bytes'] / 2**20:.0f} MiB "
    f"vs torch.utils.checkpoint {t['peak_bytes'] / 2**20:.0f} MiB"
)
