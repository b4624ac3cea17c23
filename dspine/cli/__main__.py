import sys

from dspine.cli import main

sys.exit(main())
