"""``python -m hpcnet.data generate images|tokens --out PATH [options]`` (``hpcnet.data.synthetic``)."""

import sys

from hpcnet.data.synthetic import main

sys.exit(main())
