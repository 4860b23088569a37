import sys

from danlu.hub.cli import main

sys.exit(main())
