import sys

from bigbatch.cli import main

sys.exit(main())
