"""HTTP/3 server and client (aioquic) for the attack suite's legitimate-traffic
case: QUIC with a 1,472-byte maximum datagram across nodes.

  h3.py server ADDR PORT        serves GET /NONCE with a 64 KiB body ending in NONCE
  h3.py client HOST PORT NONCE  prints {"ok": ..., "bytes": ..., "error": ...}
"""
import asyncio
import datetime
import json
import os
import ssl
import sys
import tempfile

from aioquic.asyncio import connect, serve
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ProtocolNegotiated

DATAGRAM = 1472  # the UDP payload of a full 1,500-byte IPv4 packet
BODY = 64 * 1024


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
                path = dict(e.headers).get(b":path", b"/")
                body = b"x" * (BODY - len(path)) + path
                self.h3.send_headers(e.stream_id, [(b":status", b"200"),
                                                   (b"content-length", str(len(body)).encode())])
                self.h3.send_data(e.stream_id, body, end_stream=True)
                self.transmit()


class Client(QuicConnectionProtocol):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.h3 = H3Connection(self._quic)
        self.body = b""
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
                self.body += e.data
                if e.stream_ended and not self.done.done():
                    self.done.set_result(self.body)


async def server(addr, port):
    with tempfile.TemporaryDirectory() as d:
        cfg = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN, max_datagram_size=DATAGRAM)
        cfg.load_cert_chain(*self_signed(d))
        await serve(addr, port, configuration=cfg, create_protocol=Server)
        print("ready", flush=True)
        await asyncio.sleep(60)


async def client(host, port, nonce):
    cfg = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, max_datagram_size=DATAGRAM,
                            verify_mode=ssl.CERT_NONE, idle_timeout=5)
    out = {"ok": False, "bytes": 0}
    try:
        async def run():
            async with connect(host, port, configuration=cfg, create_protocol=Client) as c:
                return await c.get(host, "/" + nonce)
        body = await asyncio.wait_for(run(), 5)
        out["bytes"] = len(body)
        out["ok"] = len(body) == BODY and body.endswith(("/" + nonce).encode())
    except Exception as e:  # a refusal shows as a timeout
        out["error"] = repr(e)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        asyncio.run(server(sys.argv[2], int(sys.argv[3])))
    else:
        asyncio.run(client(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
