import sys

from danlu.cli import main

sys.exit(main())
