import sys

from .ops.main import main

sys.exit(main())
