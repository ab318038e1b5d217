import sys

from longmixer.report.build import main

main(sys.argv[1:])
