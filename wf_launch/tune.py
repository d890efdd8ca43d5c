"""``python -m wf_launch.tune``: the command line of :mod:`wf_launch.drivers.tune.cli`."""

import sys

from wf_launch.drivers.tune.cli import main

if __name__ == "__main__":
    sys.exit(main())
