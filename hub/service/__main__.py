"""``python -m danlu.hub.service``: run the jobs service."""

import sys

from danlu.lean import skip_unused_imports

skip_unused_imports()

from danlu.hub.service.app import main

sys.exit(main())
