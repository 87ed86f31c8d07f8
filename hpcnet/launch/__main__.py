"""``python -m hpcnet.launch``: the supervisor (``hpcnet.launch.supervisor``)."""

import sys

from hpcnet.launch.supervisor import main

sys.exit(main())
