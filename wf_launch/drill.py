"""``python -m wf_launch.drill``: the command line of :mod:`wf_launch.drivers.drill`."""

import sys

from wf_launch.drivers.drill import main

if __name__ == "__main__":
    sys.exit(main())
