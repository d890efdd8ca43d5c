"""``python -m wf_launch.runs``: the command line of :mod:`wf_launch.readers.runs`."""

import sys

from wf_launch.readers.console import run_tool
from wf_launch.readers.runs import main

if __name__ == "__main__":
    sys.exit(run_tool(main))
