import sys

from shardopt.cli import main

sys.exit(main())
