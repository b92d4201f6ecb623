"""``python3 -m rotaryquant.build``: the rq-setup command line (rotaryquant.build.cli)."""

import sys

from rotaryquant.build.cli import main

sys.exit(main())
