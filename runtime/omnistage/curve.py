"""CurveZMQ between a pipeline's orchestrators and its stage workers: one keypair per pipeline.

Why one keypair and not one per process: every party that holds the pipeline's secret key is
trusted alike (an orchestrator, the operator's control path), and a worker must refuse everyone
else. So a worker is a CURVE server with the pipeline's secret key, a client connects with the
same keypair as its own, and the worker's ZAP handler admits only clients whose long-term key
is the pipeline's public key: a peer proves it holds the secret key during the handshake,
before any message of ours is read. A peer that does not speak CURVE fails the handshake in
libzmq; one with another key is refused by the ZAP handler. Both are counted
(`omnistage_worker_refused_peers_total{reason}`).

The keys themselves (made, written, read: omnistage.curve_keys, which needs no ZMQ) live in a
directory with the files `public` and `secret`, the shape of a Kubernetes Secret with those two
keys mounted as a volume. $OMNISTAGE_CURVE_KEYS names it; `omnistage serve` writes an
ephemeral pair for its own workers, the operator a Secret per pipeline.

Rotation: a worker and an orchestrator hold a CurveKeyring (curve_keys), their own pair of
generation $OMNISTAGE_CURVE_GENERATION plus every generation's public key in the directory. A
worker's identity stays its own pair; its ZAP handler admits any public key in the directory at
the time of the handshake, so while the pods roll from generation N-1 to N both generations'
orchestrators are heard, and once N-1's files are gone a new connection with that key is
refused (a connection already up stays: ZAP is asked only in the handshake). A client names
the server key of the worker's generation (secure_client's server_key).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from omnistage.curve_keys import (
    CURVE_GENERATION_ENV,
    CURVE_KEYS_ENV,
    PUBLIC_FILE,
    SECRET_FILE,
    CurveKeyError,
    CurveKeyring,
    CurveKeys,
    generate,
    generation_from_env,
    keyring_from_env,
    keys_from_env,
    load,
    public_file,
    secret_file,
    write,
)
from omnistage.zmqio import LoopSocket

__all__ = [  # the key names too: callers of the socket side need only this module
    "CURVE_GENERATION_ENV",
    "CURVE_KEYS_ENV",
    "PUBLIC_FILE",
    "SECRET_FILE",
    "CurveKeyError",
    "CurveKeyring",
    "CurveKeys",
    "PeerGate",
    "generate",
    "generation_from_env",
    "keyring_from_env",
    "keys_from_env",
    "load",
    "public_file",
    "secret_file",
    "secure_client",
    "write",
]

log = logging.getLogger("omnistage.curve")

#: The ZAP domain the workers' sockets ask about; the handler answers only for it.
ZAP_DOMAIN = b"omnistage"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)
LOG_EVERY_S = 60


def secure_client(sock: zmq.Socket[Any], keys: CurveKeys, server_key: bytes | None = None
                  ) -> None:
    """A connecting socket (before connect): the pipeline's pair is its own; the server's key
    is server_key (the worker's generation's public key, Z85) or, by default, our own public."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key or keys.public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


#: Handshake failures the worker counts, by the monitor event libzmq reports.
_REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key",  # a sound CURVE client, but not the pipeline's key
    # Not CURVE, or a handshake that fails its cryptography: a wrong server key, or a secret
    # key that is not the one behind the public key the client claims.
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake",
}


class PeerGate:
    """The worker side: makes a bound socket a CURVE server (the keyring's own pair, for the
    socket's life) whose ZAP handler admits only the pipeline's keys (keyring.admitted(), asked
    at each handshake, so a generation added to or removed from the directory counts within
    about a second), and counts the peers refused (by reason, from the socket's monitor).

    Both helper sockets are read from the loop like the worker's own (zmqio.LoopSocket). Create
    it before the socket binds, so no connection arrives before the handler is there.
    """

    def __init__(self, ctx: zmq.Context[Any], sock: zmq.Socket[Any], keyring: CurveKeyring,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.keyring = keyring
        self.refused: Counter[str] = Counter()
        self._said: dict[str, float] = {}
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_ZAP_ENDPOINT)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keyring.own.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        self._sock = sock
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self._zap_io = LoopSocket(self._zap.underlying, self._on_zap, loop)
        self._monitor_io = LoopSocket(self._monitor.underlying, self._on_monitor, loop)
        self._zap_io.read_soon()  # whatever came before the loop watched the descriptors
        self._monitor_io.read_soon()

    def _on_zap(self) -> None:
        """ZAP requests (RFC 27): version, id, domain, address, identity, mechanism, key."""
        while (frames := self._zap_io.recv(copy=True)) is not None:
            if len(frames) < 6:
                continue  # not a ZAP request; libzmq sends none such
            version, request_id, domain, _address, _identity, mechanism = frames[:6]
            key = frames[6] if len(frames) > 6 else b""
            ok = (domain == ZAP_DOMAIN and mechanism == b"CURVE"
                  and key in self.keyring.admitted())
            status, text = (b"200", b"OK") if ok else (b"400", b"not this pipeline's key")
            self._zap_io.send([version, request_id, status, text, b"" if not ok else b"peer",
                               b""])

    def _on_monitor(self) -> None:
        while (frames := self._monitor_io.recv(copy=True)) is not None:
            try:
                event = parse_monitor_message(frames)
            except (ValueError, TypeError, IndexError):  # pragma: no cover - libzmq's own frames
                continue
            reason = _REFUSALS.get(event["event"])
            if reason is not None:
                self.refused[reason] += 1
                self._say(reason)

    def _say(self, reason: str) -> None:
        """One log line for the first refusal, then one a minute at most: a refused peer
        reconnects every 100 ms and must not flood the log."""
        now = time.monotonic()
        if now - self._said.get(reason, -LOG_EVERY_S) < LOG_EVERY_S:
            return
        self._said[reason] = now
        why = ("a CURVE client with another key" if reason == "key" else
               "a peer without the pipeline's CurveZMQ key (or not speaking CURVE)")
        log.warning("refused %s; %d refused for this reason so far (next note in %d s at the "
                    "earliest)", why, self.refused[reason], LOG_EVERY_S)

    def close(self) -> None:
        self._zap_io.close()
        self._monitor_io.close()
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._zap.close(linger=0)
