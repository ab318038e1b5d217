"""`python -m longmixer.runs` is not a command: this package holds the resume, checkpoint and carry code, and the
runs listing lives in `longmixer.report.runs`. Say which commands there are rather than Python's "cannot be directly
executed"."""

import sys

sys.stderr.write("error: longmixer.runs is not a command; list the runs with `python -m longmixer.report.runs` "
                 "(or `longmixer-runs`), carry run dirs between machines with `python -m longmixer.runs.carry`\n")
sys.exit(2)
