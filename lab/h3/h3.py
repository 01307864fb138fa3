"""HTTP/3 server and client (aioquic) for the lab: the apps bench's transfer
(size mode) and the attack suite's legitimate-traffic case (nonce mode).

  h3.py server ADDR PORT [--datagram N] [--lifetime S]
        serves GET /bytes/N with an N-byte body, and any other GET /PATH with
        a 64 KiB body ending in /PATH; prints "ready"; stops when stdin
        closes, or after S seconds with --lifetime
  h3.py client HOST PORT size N [--datagram N] [--timeout S]
  h3.py client HOST PORT nonce NONCE [--datagram N] [--timeout S]
        one GET on a new connection (GET /bytes/N, or GET /nonce/NONCE);
        prints {"ok": ..., "bytes": ..., "seconds": ..., "error": ...}:
        ok is the whole body (N bytes; 64 KiB ending in the nonce's path),
        seconds the handshake, request and body

--datagram is QUIC's maximum datagram size (aioquic's default, 1,200
bytes, without it); --timeout bounds the client's whole exchange and its
idle timeout (default 60 s).
"""
import argparse
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

NONCE_BODY = 64 * 1024
SIZE_PREFIX = b"/bytes/"
TAIL = 256  # the bytes of a body the client keeps: more than a nonce's path


def self_signed(d):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "palisade-h3")])
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


def body_for(path):
    if path.startswith(SIZE_PREFIX):
        try:
            return b"x" * min(int(path[len(SIZE_PREFIX):]), 1 << 30)
        except ValueError:
            return b""
    return b"x" * (NONCE_BODY - len(path)) + path


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
                body = body_for(dict(e.headers).get(b":path", b"/"))
                self.h3.send_headers(e.stream_id, [(b":status", b"200"),
                                                   (b"content-length", str(len(body)).encode())])
                self.h3.send_data(e.stream_id, body, end_stream=True)
                self.transmit()


class Client(QuicConnectionProtocol):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.h3 = H3Connection(self._quic)
        # The body's length and its last bytes, not the body: the size
        # mode's transfer costs the client no copies.
        self.got = 0
        self.tail = b""
        self.done = None

    async def get(self, authority, path):
        sid = self._quic.get_next_available_stream_id()
        self.done = self._loop.create_future()
        self.h3.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                   (b":authority", authority.encode()), (b":path", path.encode())],
                             end_stream=True)
        self.transmit()
        return await self.done

    def quic_event_received(self, ev):
        for e in self.h3.handle_event(ev):
            if isinstance(e, DataReceived):
                self.got += len(e.data)
                self.tail = (self.tail + e.data[-TAIL:])[-TAIL:]
                if e.stream_ended and not self.done.done():
                    self.done.set_result(True)


def quic_config(a, **kw):
    if a.datagram:
        kw["max_datagram_size"] = a.datagram
    return QuicConfiguration(alpn_protocols=H3_ALPN, **kw)


async def server(a):
    with tempfile.TemporaryDirectory() as d:
        cfg = quic_config(a, is_client=False)
        cfg.load_cert_chain(*self_signed(d))
        await serve(a.addr, a.port, configuration=cfg, create_protocol=Server)
        print("ready", flush=True)
        if a.lifetime:
            await asyncio.sleep(a.lifetime)
        else:
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def client(a):
    cfg = quic_config(a, is_client=True, verify_mode=ssl.CERT_NONE, idle_timeout=a.timeout)
    path = "/bytes/%d" % int(a.arg) if a.mode == "size" else "/nonce/" + a.arg
    out = {"ok": False, "bytes": 0, "seconds": 0.0, "error": ""}
    t0 = time.monotonic()
    try:
        async def run():
            async with connect(a.host, a.port, configuration=cfg, create_protocol=Client) as c:
                await c.get("%s:%d" % (a.host, a.port), path)
                out["seconds"] = time.monotonic() - t0  # before the close
                return c
        c = await asyncio.wait_for(run(), a.timeout)
        out["bytes"] = c.got
        if a.mode == "size":
            out["ok"] = c.got == int(a.arg)
        else:
            out["ok"] = c.got == NONCE_BODY and c.tail.endswith(path.encode())
    except Exception as e:  # reported, judged by the caller (a refusal shows as a timeout)
        out["error"] = repr(e)
    print(json.dumps(out), flush=True)


def main():
    p = argparse.ArgumentParser(prog="h3.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("server")
    s.add_argument("addr")
    s.add_argument("port", type=int)
    s.add_argument("--datagram", type=int)
    s.add_argument("--lifetime", type=float)
    c = sub.add_parser("client")
    c.add_argument("host")
    c.add_argument("port", type=int)
    c.add_argument("mode", choices=["size", "nonce"])
    c.add_argument("arg")
    c.add_argument("--datagram", type=int)
    c.add_argument("--timeout", type=float, default=60)
    a = p.parse_args()
    asyncio.run(server(a) if a.cmd == "server" else client(a))


if __name__ == "__main__":
    main()
