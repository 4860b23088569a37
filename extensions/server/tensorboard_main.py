"""``python -m danlu.lab.tensorboard_main ARGS``: TensorBoard that answers only requests carrying its token.

TensorBoard has no login of its own and listens on a TCP port of the loopback
interface, which every account of the machine, and every kernel, can reach.
The Jupyter server that starts it (:mod:`danlu.lab.tensorboard`) hands it a
random token in its environment (never on its command line, which every
account can read in ``/proc``) and adds that token to each request it proxies
after Jupyter's own login; any other request gets 403. ``ARGS`` are
TensorBoard's own (``--logdir_spec``, ``--host``, ``--port``, ...).
"""

from __future__ import annotations

import hmac
import os
import sys

from danlu import env

#: the request header that carries the token (the WSGI environ's HTTP_X_DANLU_TENSORBOARD_TOKEN)
HEADER = "X-Danlu-TensorBoard-Token"
#: the shortest token accepted
MIN_TOKEN = 32


def guarded(app, token: str):
    """``app`` (WSGI) behind the token: a request without it gets 403, before TensorBoard sees it."""
    expected = token.encode()
    key = "HTTP_" + HEADER.upper().replace("-", "_")

    def wsgi(environ, start_response):
        if not hmac.compare_digest(environ.get(key, "").encode(), expected):
            start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"this TensorBoard answers only through its owner's Jupyter server\n"]
        return app(environ, start_response)

    return wsgi


def main() -> int:
    token = os.environ.pop(env.TENSORBOARD_TOKEN, "")
    if len(token) < MIN_TOKEN:
        print(f"danlu: ${env.TENSORBOARD_TOKEN} is not set: start TensorBoard from the Danlu sidebar", file=sys.stderr)
        return 2
    from absl import app  # deferred: TensorBoard's own imports (~2 s), after the token is checked
    from tensorboard import default, program  # deferred: as absl

    class Server(program.WerkzeugServer):
        def __init__(self, wsgi_app, flags):
            super().__init__(guarded(wsgi_app, token), flags)

    board = program.TensorBoard(plugins=default.get_plugins(), server_class=Server)
    app.run(board.main, flags_parser=board.configure, argv=[sys.argv[0], *sys.argv[1:]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
