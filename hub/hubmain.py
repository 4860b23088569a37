"""``python -m danlu.hub.hubmain ARGS``: ``jupyterhub ARGS``, as ``danlu up`` starts it.

JupyterHub itself, unchanged, with :func:`danlu.lean.skip_unused_imports` applied first (the
hub imports jsonschema through jupyter_events).
"""

from danlu.lean import skip_unused_imports

skip_unused_imports()

from jupyterhub.app import main

if __name__ == "__main__":
    main()
