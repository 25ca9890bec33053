"""Does a recipe fit a GPU cluster, and how long will it take?

    python tools/plan.py recipes/cpt_4m.yaml [--gpu h100|h200|b200] [--gpus 256] [--mfu 0.35] [--set k=v]
    python tools/plan.py recipes/cpt_4m.yaml --eval 128K:4M:6 [--gpus 64 --tp 8 --cp 8] [--prompts 11]

See `python tools/plan.py --help` (megatron_ext/plan_cli.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_ext.plan_cli import main  # noqa: E402

if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `plan.py ... | head` ends quietly, as a Unix filter does
    sys.exit(main())
