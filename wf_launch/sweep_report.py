"""``python -m wf_launch.sweep_report SWEEP_DIR``: the command line of
:mod:`wf_launch.readers.sweep.report`."""

import sys

from wf_launch.readers.sweep.report import main

if __name__ == "__main__":
    sys.exit(main())
