"""Worker: run a module as `python -m MODULE ARGS` would, under a file-size limit (RLIMIT_FSIZE): a write past
BYTES fails with EFBIG, as one past a full disk fails with ENOSPC (no root needed, unlike a small tmpfs).

    file_size_limit.py BYTES MODULE [ARGS...]
"""

import resource
import runpy
import sys

limit, module = int(sys.argv[1]), sys.argv[2]
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
