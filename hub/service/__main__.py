"""``python -m danlu.hub.service``: run the jobs service."""

import sys

from danlu.hub.service.app import main

sys.exit(main())
