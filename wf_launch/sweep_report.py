"""``python -m wf_launch.sweep_report SWEEP_DIR``: the command line of :mod:`wf_launch.tools.sweep.report`."""

import sys

from wf_launch.tools.sweep.report import main

if __name__ == "__main__":
    sys.exit(main())
