"""``python -m hpcnet.report RUN_DIR [--out DIR]``."""

import sys

from hpcnet.report.build import main

sys.exit(main())
