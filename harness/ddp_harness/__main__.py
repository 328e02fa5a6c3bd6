import sys

from ddp_harness.cli import main

sys.exit(main())
