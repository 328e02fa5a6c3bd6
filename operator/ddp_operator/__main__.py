import sys

from ddp_operator.cli import main

sys.exit(main())
