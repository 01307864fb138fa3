# Guest side of TestLSMVM: abstract Unix listeners and connectors as
# different users (fork + setresuid), one result line per case.
import errno, os, socket, sys, time

PFX = '\0palul.'

def ids(uid, gid, groups):
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)

def serve(name, uid, gid, groups=()):
    """Stream listener and datagram socket on PFX+name+'.s'/'.d' owned by uid/gid."""
    pid = os.fork()
    if pid:
        return pid
    os.setpgid(0, 0)
    ids(uid, gid, list(groups))
    st = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    st.bind(PFX + name + '.s'); st.listen(16)
    dg = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dg.bind(PFX + name + '.d')
    if os.fork() == 0:
        while True:
            c, _ = st.accept()
            d = c.recv(100)
            print('GOT %s.s %s' % (name, d.decode()), flush=True)
            c.sendall(b'echo ' + d); c.close()
    while True:
        d, peer = dg.recvfrom(100)
        print('GOT %s.d %s' % (name, d.decode()), flush=True)
        try:
            dg.sendto(b'echo ' + d, peer)
        except OSError as e:
            print('REPLY-ERR %s.d %s' % (name, errno.errorcode.get(e.errno, e.errno)), flush=True)

def attempt(uid, gid, groups, fn):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            ids(uid, gid, list(groups))
            res = fn()
        except socket.timeout:
            res = 'TIMEOUT'
        except OSError as e:
            res = 'ERR ' + errno.errorcode.get(e.errno, str(e.errno))
        os.write(w, res.encode()); os._exit(0)
    os.close(w)
    out = b''
    while True:
        b = os.read(r, 100)
        if not b: break
        out += b
    os.waitpid(pid, 0)
    return out.decode()

def stream(name, msg):
    def f():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(3)
        s.connect(PFX + name + '.s'); s.sendall(msg.encode())
        return 'OK ' + s.recv(100).decode()
    return f

def dgram(name, msg, connect=False):
    def f():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.settimeout(3)
        s.bind(b'')  # autobind: the server can answer
        if connect:
            s.connect(PFX + name + '.d'); s.send(msg.encode())
        else:
            s.sendto(msg.encode(), PFX + name + '.d')
        try:
            return 'OK ' + s.recv(100).decode()
        except socket.timeout:
            return 'SENT-NOREPLY'
    return f

def pathname(path, msg):
    def f():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.settimeout(3)
        s.connect(path); s.sendall(msg.encode())
        return 'OK ' + s.recv(100).decode()
    return f

def serve_path(path, uid, gid):
    pid = os.fork()
    if pid:
        return pid
    os.setpgid(0, 0)
    ids(uid, gid, [])
    os.umask(0)
    st = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    st.bind(path); st.listen(4)
    while True:
        c, _ = st.accept(); d = c.recv(100)
        print('GOT path %s' % d.decode(), flush=True)
        c.sendall(b'echo ' + d); c.close()

# case name, uid, gid, groups, function
ALICE, BOB, CAROL, SVC, PROJ = 2001, 2002, 2003, 2004, 2100
scope = sys.argv[1]
pids = [serve('alice', ALICE, ALICE), serve('proj', ALICE, PROJ, [PROJ]), serve('root', 0, 0)]
cases = []
if scope == 'enforced':
    for kind, fn in (('stream', stream), ('dgram', dgram)):
        cases += [
            (kind + '-same-user', ALICE, ALICE, [], fn('alice', 'm1')),
            (kind + '-other-user', BOB, BOB, [], fn('alice', 'm2')),
            (kind + '-exempt-connector-svc', SVC, SVC, [], fn('alice', 'm3')),
            (kind + '-exempt-connector-root', 0, 0, [], fn('alice', 'm4')),
            (kind + '-shared-group', BOB, BOB, [PROJ], fn('proj', 'm5')),
            (kind + '-group-nonmember', CAROL, CAROL, [], fn('proj', 'm6')),
            (kind + '-group-not-listeners', BOB, BOB, [PROJ], fn('alice', 'm7')),
            (kind + '-exempt-listener-root', BOB, BOB, [], fn('root', 'm8')),
        ]
    cases += [
        ('dgram-connect-other-user', BOB, BOB, [], dgram('alice', 'm9', connect=True)),
        ('dgram-connect-same-user', ALICE, ALICE, [], dgram('alice', 'm10', connect=True)),
    ]
    pids.append(serve_path('/tmp/palul.sock', ALICE, ALICE))
    time.sleep(0.5)
    cases.append(('pathname-other-user', BOB, BOB, [], pathname('/tmp/palul.sock', 'm11')))
else:
    cases += [
        ('other-netns-stream-other-user', BOB, BOB, [], stream('alice', 'n1')),
        ('other-netns-dgram-other-user', BOB, BOB, [], dgram('alice', 'n2')),
    ]
time.sleep(0.5)
for name, uid, gid, groups, fn in cases:
    print('RESULT %s %s' % (name, attempt(uid, gid, groups, fn)), flush=True)
time.sleep(0.3)
for p in pids:
    os.killpg(p, 9)
