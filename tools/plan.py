"""Does a recipe fit a GPU cluster, and how long will it take?

    python tools/plan.py recipes/cpt_4m.yaml [--gpu h100|h200|b200] [--gpus 256] [--mfu 0.35] [--set k=v]
    python tools/plan.py recipes/cpt_4m.yaml --eval 128K:4M:6 [--gpus 64 --tp 8 --cp 8] [--prompts 11]

Prints the per-GPU memory breakdown, the verdict, tokens/s/GPU and the hours for the recipe's
steps, the smallest context-parallel size that fits for each recompute mode and a recommendation.
With --eval: the same for evaluating the recipe's model on the Megatron engine at the recipe's TP x PP x CP
(`tools/niah.py --engine megatron`): memory per GPU, time of a prompt and of a grid, per length.
Exits 1 with the reason when the recipe does not fit or the input is wrong.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megatron_ext.plan_cli import main  # noqa: E402

if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `plan.py ... | head` ends quietly, as a Unix filter does
    sys.exit(main())
