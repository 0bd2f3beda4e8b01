"""Print the three walks of ``docs/architecture.md``, measured: one gradient, one save, one load,
as the files of ours control enters, in order (``higgs_megatron_bench.walks``).

    python scripts/walks.py
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from higgs_megatron_bench.walks import WALK_ARGV, measure_walks  # noqa: E402

def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as directory:
        walks = measure_walks(WALK_ARGV, directory)
    for name, walk in walks.items():
        logging.info(f"{name}: {len(walk.files)} files, entered more than once: "
                     f"{', '.join(walk.reentered) or 'none'}\n  {walk.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
