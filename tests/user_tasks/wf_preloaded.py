"""A module a test task asks the launcher to preload: it records which process imported it."""

import os

IMPORTED_BY = os.getpid()
