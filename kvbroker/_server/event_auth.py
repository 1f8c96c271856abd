"""Who may subscribe to the KV event stream: ZMQ CURVE keys for :mod:`kvbroker._server.events`.

A ``BlockStored`` carries a prompt's token ids, so the stream is as sensitive as the prompts.
A PUB socket sends every subscriber the same messages, and with vLLM's endpoint rule anyone
can get them: the bind form (``tcp://*:5557``) takes subscribers from any host, and in the
connect form (``tcp://host:5557``) any local user who binds that port first receives the
stream. So the publisher can authenticate its subscribers with ZMQ's CURVE (``curve``:
:class:`CurveKeys`, through pyzmq's ``zmq.auth`` ZAP authenticator): the daemon is the CURVE
server on both sockets (in the connect form too), and only a subscriber holding the secret
key of one of the public certificates in the clients directory completes the handshake —
whoever binds the port first or connects from elsewhere gets nothing. Authenticated
subscribers are trusted with every namespace (routers, like administrators). The daemon's
tenant rule (which events enter the stream) is :mod:`kvbroker._server.fleet`'s: under
``isolation.mode = "tenant"`` a stream without CURVE carries only the blocks of namespaces
every user may read (``[isolation.shared."..."] read = ["*"]``). CURVE rather than
per-tenant endpoints because routers usually run on another host (IPC files with per-tenant
modes reach none of them) and one authenticated stream is what they consume today; rather
than leaving token ids out, because a router computes its block hashes from the token ids
(llm-d, Dynamo), and the bare hashes would still tell any listener which prompts another
tenant has cached.
"""

from __future__ import annotations

import os

from .event_wire import import_zmq

__all__ = ["CurveKeys"]


class CurveKeys:
    """The daemon's CURVE key pair and the public keys of the subscribers it accepts.

    ``secret_file``: a certificate with both keys, as ``zmq.auth.create_certificates`` writes
    (``NAME.key_secret``); it must not be readable by group or others. ``clients_dir``: a
    directory of subscribers' public certificates (``*.key``, the czmq layout
    ``zmq.auth.load_certificates`` reads), at least one. Raises ValueError saying what is
    wrong; the files are read once (a restart picks up new subscribers)."""

    def __init__(self, secret_file: str, clients_dir: str) -> None:
        zmq = import_zmq()  # or ImportError naming the extra
        import zmq.auth  # noqa: F811 - the submodule, on the same package

        if not zmq.has("curve"):
            raise ValueError("this libzmq was built without CURVE security")
        try:
            st = os.stat(secret_file)
        except OSError as exc:
            raise ValueError(f"curve key {secret_file}: {exc.strerror}") from None
        if st.st_mode & 0o077:
            raise ValueError(
                f"curve key {secret_file}: a secret key must not be accessible by "
                "group or others (chmod 600)"
            )
        try:
            public, secret = zmq.auth.load_certificate(secret_file)
        except (OSError, ValueError) as exc:
            raise ValueError(f"curve key {secret_file}: {exc}") from None
        if not secret:
            raise ValueError(
                f"curve key {secret_file}: no secret-key in it (give the "
                "*.key_secret file zmq.auth.create_certificates wrote)"
            )
        if not os.path.isdir(clients_dir):
            raise ValueError(f"curve clients {clients_dir}: not a directory")
        try:
            clients = zmq.auth.load_certificates(clients_dir)
        except (OSError, ValueError) as exc:
            raise ValueError(f"curve clients {clients_dir}: {exc}") from None
        if not clients:
            raise ValueError(
                f"curve clients {clients_dir}: no public certificate (*.key) in "
                "it: no subscriber could connect"
            )
        self.public, self.secret = public, secret
        self.clients_dir = clients_dir
        self.clients = len(clients)
