"""HTTP/3 transfer for palisade-lab bench --suites apps (aioquic).

  h3bench.py server ADDR PORT          serves GET /N with an N-byte body; prints "ready",
                                       stops when stdin closes
  h3bench.py client HOST PORT N        one GET /N on a new connection; prints
                                       {"bytes": ..., "seconds": ..., "error": ...}
                                       (seconds: handshake, request and body)
"""
import asyncio
import datetime
import json
import os
import ssl
import sys
import tempfile
import time

from aioquic.asyncio import connect, serve
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ProtocolNegotiated


def self_signed(d):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "palisade-h3bench")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    c, k = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
    with open(c, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(k, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return c, k


class Server(QuicConnectionProtocol):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.h3 = None

    def quic_event_received(self, ev):
        if isinstance(ev, ProtocolNegotiated):
            self.h3 = H3Connection(self._quic)
        if self.h3 is None:
            return
        for e in self.h3.handle_event(ev):
            if isinstance(e, HeadersReceived):
                path = dict(e.headers).get(b":path", b"/0")
                try:
                    n = min(int(path[1:]), 1 << 30)
                except ValueError:
                    n = 0
                self.h3.send_headers(e.stream_id, [(b":status", b"200"), (b"content-length", str(n).encode())])
                self.h3.send_data(e.stream_id, b"x" * n, end_stream=True)
                self.transmit()


class Client(QuicConnectionProtocol):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.h3 = H3Connection(self._quic)
        self.got = 0
        self.done = None

    async def get(self, authority, path):
        sid = self._quic.get_next_available_stream_id()
        self.done = self._loop.create_future()
        self.h3.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                   (b":authority", authority.encode()), (b":path", path.encode())],
                             end_stream=True)
        self.transmit()
        await self.done

    def quic_event_received(self, ev):
        for e in self.h3.handle_event(ev):
            if isinstance(e, DataReceived):
                self.got += len(e.data)
                if e.stream_ended and not self.done.done():
                    self.done.set_result(True)


async def server(addr, port):
    d = tempfile.mkdtemp()
    c, k = self_signed(d)
    cfg = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    cfg.load_cert_chain(c, k)
    await serve(addr, port, configuration=cfg, create_protocol=Server)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def client(host, port, n):
    cfg = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, verify_mode=ssl.CERT_NONE)
    res = {"bytes": 0, "seconds": 0.0, "error": ""}
    t0 = time.monotonic()
    try:
        async with connect(host, port, configuration=cfg, create_protocol=Client) as c:
            await asyncio.wait_for(c.get(f"{host}:{port}", f"/{n}"), 60)
            res["seconds"] = time.monotonic() - t0
            res["bytes"] = c.got
    except Exception as e:  # reported, judged by the bench
        res["error"] = repr(e)
    print(json.dumps(res))


if __name__ == "__main__":
    if sys.argv[1] == "server":
        asyncio.run(server(sys.argv[2], int(sys.argv[3])))
    else:
        asyncio.run(client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
