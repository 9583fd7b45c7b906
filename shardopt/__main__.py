import sys

from shardopt.tools.cli import main

sys.exit(main())
