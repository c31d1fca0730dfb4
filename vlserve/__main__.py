import sys

from vlserve.cli import main

sys.exit(main())
