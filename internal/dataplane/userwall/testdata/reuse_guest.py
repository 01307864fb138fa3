# Guest side of TestLSMVM's port-sharing check (run as root in the agent's
# namespace while the agent enforces): a user's SO_REUSEADDR becomes
# SO_REUSEPORT (uw_setsockopt, reuse_to_port), so two of uid 2001's sockets
# share a port and uid 2002's may not join them. Prints one line:
# REUSE own=<OK|errno> reuseaddr=<0|1> reuseport=<0|1> other=<OK|errno>
import errno, os, socket, sys

PORT = 40123


def sock():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return s


def become(uid):
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def err(e):
    return errno.errorcode.get(e.errno, str(e.errno))


ready_r, ready_w = os.pipe()
done_r, done_w = os.pipe()
pid = os.fork()
if pid == 0:
    become(2001)
    out = []
    try:
        a, b = sock(), sock()
        a.bind(("0.0.0.0", PORT))
        b.bind(("0.0.0.0", PORT))
        out.append("own=OK")
        out.append("reuseaddr=%d" % a.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR))
        out.append("reuseport=%d" % a.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT))
    except OSError as e:
        out.append("own=" + err(e))
    os.write(ready_w, " ".join(out).encode())
    os.read(done_r, 1)  # hold the sockets until uid 2002 has tried
    os._exit(0)
own = os.read(ready_r, 4096).decode()
r, w = os.pipe()
pid2 = os.fork()
if pid2 == 0:
    become(2002)
    try:
        sock().bind(("0.0.0.0", PORT))
        res = "other=OK"
    except OSError as e:
        res = "other=" + err(e)
    os.write(w, res.encode())
    os._exit(0)
os.waitpid(pid2, 0)
other = os.read(r, 4096).decode()
os.write(done_w, b"x")
os.waitpid(pid, 0)
print("REUSE", own, other)
sys.stdout.flush()
