"""``python -m wf_launch.plot``: the command line of :mod:`wf_launch.readers.plot`."""

import sys

from wf_launch.readers.console import run_tool
from wf_launch.readers.plot import main

if __name__ == "__main__":
    sys.exit(run_tool(main))
