"""`python -m vlserve.dynamo ...`: the same as `vlserve dynamo-worker ...` (how Dynamo's backends are started)."""

import sys

from vlserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["dynamo-worker", *sys.argv[1:]]))
