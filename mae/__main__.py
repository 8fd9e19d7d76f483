"""`python -m mae`, `accelerate launch -m mae <stage>` and `torchrun -m mae <stage>`."""

import sys

from mae.cli import main

sys.exit(main())
