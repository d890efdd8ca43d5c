"""``python -m wf_launch.status``: the command line of :mod:`wf_launch.tools.status`."""

import sys

from wf_launch.tools.status import main

if __name__ == "__main__":
    sys.exit(main())
