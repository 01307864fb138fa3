package attack

import (
	"bufio"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	"github.com/palisade-hpc/palisade/lab/h3"
	uwlab "github.com/palisade-hpc/palisade/lab/modes/userwall"
)

// Legitimate traffic the identity stamp once cost (issue 20): datagrams near
// the MTU, fragmented, large (60 KiB), UDP GSO, a connected UDP socket whose
// exchange outlives the reply permission's lifetime, a Fast Open SYN full of
// data, real applications (iperf3, HTTP/3). Each reaches alice's socket (the
// control) and not bob's (the attack, on the same path).
func casesUDP() []*Case {
	var cs []*Case
	for _, fam := range []int{4, 6} {
		for _, size := range []int{1400, 1472, 8000, 61440} {
			cs = append(cs, datagramSize(false, fam, size))
		}
		cs = append(cs, datagramSize(true, fam, 61440), udpGSO(fam), iperfUDP(fam), http3(fam))
	}
	return append(cs, connectedUDPTTL(), fastOpenFull())
}

func datagramSize(local bool, fam, size int) *Case {
	return &Case{Name: fmt.Sprintf("udp-size-%d-%s-v%d", size, where(local), fam), Class: "legit-size",
		Why: fmt.Sprintf("a %d-byte datagram (near the MTU, fragmented or larger than an skb may grow) carries its sender's identity: alice's reaches her socket, bob's is refused", size),
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), e.Port)}})
			if err != nil {
				return err
			}
			node, dst := e.B.Name, eth(e.A, fam)
			if local {
				node, dst = e.A.Name, lo(fam)
			}
			spec := ActSpec{Sock: sock("udp", fam), Dst: ap(dst, e.Port), Size: size, Count: 2}
			desc := fmt.Sprintf("udp %d bytes → %s", size, spec.Dst)
			r.Attack(e, s, node, Attacker, desc, spec)
			r.Control(e, s, node, Victim, desc, spec)
			return nil
		}}
}

func udpGSO(fam int) *Case {
	return &Case{Name: fmt.Sprintf("udp-gso-cross-v%d", fam), Class: "legit-size",
		Why: "one UDP_SEGMENT send of four 1,400-byte segments: the GSO packet is stamped once and every segment carries the copy",
		Run: func(e *Env, r *Run) error {
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "udp", Family: fam, Bind: ap(wild(fam), e.Port)}})
			if err != nil {
				return err
			}
			spec := ActSpec{Sock: sock("udp", fam), Dst: ap(eth(e.A, fam), e.Port), Size: 4 * 1400, GSO: 1400}
			desc := "udp GSO 4×1400 → " + spec.Dst
			r.Attack(e, s, e.B.Name, Attacker, desc, spec)
			r.Control(e, s, e.B.Name, Victim, desc, spec)
			return nil
		}}
}

// background runs argv as user on node until the case ends; ready, if not
// "", is a line its output must print before this returns.
func (e *Env) background(r *Run, node, user, ready string, argv ...string) error {
	cmd := e.TB.Command(e.Ctx, node, asUser(user), argv...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	cmd.WaitDelay = 2 * time.Second
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	r.Defer(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(3 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	got := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(out)
		seen := ready == ""
		for sc.Scan() {
			if !seen && strings.TrimSpace(sc.Text()) == ready {
				seen = true
				got <- true
			}
		}
		if !seen {
			got <- false
		}
		cmd.Wait()
		close(done)
	}()
	if ready == "" {
		return nil
	}
	select {
	case ok := <-got:
		if !ok {
			return fmt.Errorf("%s@%s %s: exited before %q: %s", user, node, argv[0], ready, strings.TrimSpace(stderr.String()))
		}
		return nil
	case <-time.After(15 * time.Second):
		return fmt.Errorf("%s@%s %s: not ready after 15 s", user, node, argv[0])
	}
}

// iperfUDP runs iperf3 (UDP, 2 Mbit/s for a second) at three datagram
// sizes from B to alice's server on A: alice's client must lose nothing;
// bob's, aimed at the same server, must get nothing through.
func iperfUDP(fam int) *Case {
	return &Case{Name: fmt.Sprintf("udp-iperf3-cross-v%d", fam), Class: "legit-app",
		Why: "iperf3 UDP at 1,400, 1,472 and 8,000 bytes (near the MTU and fragmented) as a real application: alice's test to her own server loses no datagram; bob's is refused",
		Run: func(e *Env, r *Run) error {
			for i, size := range []int{1400, 1472, 8000} {
				for j, u := range []string{Attacker, Victim} {
					// A server of its own for each (bob's one-off server
					// never sees its client: it ends with the case).
					port := e.Port + 2*i + j
					if err := e.background(r, e.A.Name, Victim, "", "iperf3", "-s", "-1", "-p", itoa(port)); err != nil {
						return err
					}
					if !e.listening(e.A.Name, port) {
						return fmt.Errorf("iperf3 server on %s:%d not listening", e.A.Name, port)
					}
					out, err := e.TB.Output(e.Ctx, e.B.Name, asUser(u), "iperf3", "-"+itoa(fam), "-c", eth(e.A, fam).String(),
						"-p", itoa(port), "-u", "-l", itoa(size), "-b", "2M", "-t", "1", "--json")
					var res struct {
						End struct {
							Sum struct {
								Packets     int `json:"packets"`
								LostPackets int `json:"lost_packets"`
							} `json:"sum"`
						} `json:"end"`
						Error string `json:"error"`
					}
					// iperf3 may warn before its JSON (e.g. a block size
					// larger than the TCP MSS).
					if i := strings.Index(out, "{"); i > 0 {
						out = out[i:]
					}
					jerr := json.Unmarshal([]byte(out), &res)
					sum := res.End.Sum
					ok := err == nil && jerr == nil && res.Error == "" && sum.Packets > 0 && sum.LostPackets == 0
					ev := fmt.Sprintf("%d datagrams sent, %d lost", sum.Packets, sum.LostPackets)
					if res.Error != "" || jerr != nil {
						ev = strings.TrimSpace(res.Error + " " + fmt.Sprint(jerr))
					}
					desc := fmt.Sprintf("iperf3 -u -l %d → %s:%d", size, eth(e.A, fam), port)
					if u == Attacker {
						// Delivered if any of bob's test got through.
						r.Judged(true, e.B.Name, u, desc, err == nil && sum.Packets > sum.LostPackets, ev)
					} else {
						r.Judged(false, e.B.Name, u, desc, ok, ev)
					}
				}
			}
			return nil
		}}
}

// h3Datagram is the case's QUIC maximum datagram: the UDP payload of a
// full 1,500-byte IPv4 packet.
const h3Datagram = "1472"

func http3(fam int) *Case {
	return &Case{Name: fmt.Sprintf("http3-1472-cross-v%d", fam), Class: "legit-app",
		Why: "HTTP/3 (aioquic) with a 1,472-byte maximum datagram, a 64 KiB response: alice's client gets her server's page; bob's QUIC handshake is refused",
		Run: func(e *Env, r *Run) error {
			if _, err := os.Stat(h3.Python); err != nil {
				return fmt.Errorf("%s: %w (run .ci/deps)", h3.Python, err)
			}
			script := filepath.Join(e.TB.Dir, "pal-attack-h3.py") // the instance's own: suites run side by side
			if err := h3.Write(script); err != nil {
				return err
			}
			if err := e.background(r, e.A.Name, Victim, "ready", h3.Python, script, "server", wild(fam).String(), itoa(e.Port),
				"--datagram", h3Datagram, "--lifetime", "60"); err != nil {
				return err
			}
			for _, u := range []string{Attacker, Victim} {
				nonce := newNonce()
				out, _ := e.TB.Output(e.Ctx, e.B.Name, asUser(u), h3.Python, script, "client", eth(e.A, fam).String(), itoa(e.Port),
					"nonce", nonce, "--datagram", h3Datagram, "--timeout", "5")
				var res struct {
					OK    bool   `json:"ok"`
					Bytes int    `json:"bytes"`
					Error string `json:"error"`
				}
				if err := json.Unmarshal([]byte(lastLine(out)), &res); err != nil {
					return fmt.Errorf("h3 client %s: %v: %s", u, err, out)
				}
				ev := fmt.Sprintf("%d bytes", res.Bytes)
				if res.Error != "" {
					ev += ", " + res.Error
				}
				r.Judged(u == Attacker, e.B.Name, u, "HTTP/3 GET https://"+ap(eth(e.A, fam), e.Port)+"/"+nonce, res.OK, ev)
			}
			return nil
		}}
}

func lastLine(s string) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	return l[len(l)-1]
}

// connClient is alice's connected UDP client: it sends with send() (no
// address: no sendmsg hook runs) every 250 ms for the given seconds,
// counting the answers, then asks for a late answer and stays silent.
const connClient = `
import json, socket, sys, time
fam = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(fam, socket.SOCK_DGRAM)
s.connect((sys.argv[1], int(sys.argv[2])))
s.settimeout(0.25)
sent = got = late = 0
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    try:
        s.send(b"ping %d" % sent)
    except OSError:
        pass  # an ICMP error of an earlier datagram surfaces here
    sent += 1
    t = time.monotonic() + 0.25
    while time.monotonic() < t:
        try:
            if s.recv(2048).startswith(b"ping"):
                got += 1
        except OSError:
            pass
s.send(b"late")
end = time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:
    try:
        if s.recv(2048) == b"late":
            late += 1
    except OSError:
        pass
print(json.dumps({"sent": sent, "got": got, "late": late}))
`

// connServer answers every datagram at once, and "late" after a delay
// longer than the reply permission lives once the client stops sending.
const connServer = `
import socket, sys, time
fam = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(fam, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    d, peer = s.recvfrom(2048)
    if d == b"late":
        time.sleep(float(sys.argv[3]))
    s.sendto(d, peer)
`

// connectedUDPTTL: alice's connected UDP socket talks to an off-cluster
// server (whose answers are replies: they need the socket's peer record)
// for three peer lifetimes, sending with send(). Node A's agent runs with a
// peer lifetime of 2 s for the case (userwall.TestPeerTTLEnv).
func connectedUDPTTL() *Case {
	const ttl = 2
	return &Case{Name: "udp-connected-outlives-peer-ttl", Class: "udp-reply",
		Why: "a connected UDP socket sends with send() (no sendmsg hook runs): its peer's answers must keep coming for as long as it sends (control), and stop once it has been silent longer than the peer lifetime (attack: the late answer)",
		Run: func(e *Env, r *Run) error {
			r.Defer(func() { e.restoreAgent(e.A) })
			if err := uwlab.TermAgent(e.TB, e.A.Name); err != nil {
				return err
			}
			if err := uwlab.StartAgentEnv(e.Ctx, e.TB, e.A, []string{kernel.TestPeerTTLEnv + "=" + itoa(ttl)}); err != nil {
				return err
			}
			if err := e.background(r, e.Outside.Name, "root", "ready", "python3", "-c", connServer, "0.0.0.0", itoa(e.Port), itoa(ttl+2)); err != nil {
				return err
			}
			out, err := e.TB.Output(e.Ctx, e.A.Name, Victim, "python3", "-c", connClient, e.Outside.Eth0V4.String(), itoa(e.Port),
				itoa(3*ttl), itoa(ttl+4))
			var res struct{ Sent, Got, Late int }
			if jerr := json.Unmarshal([]byte(lastLine(out)), &res); jerr != nil {
				return errors.Join(fmt.Errorf("connected client: %s", out), err, jerr)
			}
			to := ap(e.Outside.Eth0V4, e.Port)
			r.Judged(false, e.A.Name, Victim, fmt.Sprintf("connected udp → %s, send() for %d s", to, 3*ttl),
				res.Sent > 0 && res.Got == res.Sent, fmt.Sprintf("%d answers to %d datagrams", res.Got, res.Sent))
			r.Judged(true, e.Outside.Name, "root", fmt.Sprintf("answer from %s %d s after alice's last send", to, ttl+2),
				res.Late > 0, fmt.Sprintf("%d late answers", res.Late))
			return nil
		}}
}

// fastOpenFull: a Fast Open SYN with as much data as the stack puts in it
// (the MSS less the option space) must still leave stamped.
func fastOpenFull() *Case {
	return &Case{Name: "tcp-fastopen-full-syn-cross", Class: "legit-size",
		Why: "a TCP Fast Open SYN filled with data (1,460 bytes offered: the stack puts what fits the route's MSS in the SYN) is stamped: alice's reaches her listener, bob's is refused",
		Run: func(e *Env, r *Run) error {
			for _, n := range []string{e.A.Name, e.B.Name} {
				old, err := e.Root(n, "sysctl", "-n", "net.ipv4.tcp_fastopen")
				if err != nil {
					return err
				}
				r.Defer(func() { e.Root(n, "sysctl", "-qw", "net.ipv4.tcp_fastopen="+strings.TrimSpace(old)) })
				if _, err := e.Root(n, "sysctl", "-qw", "net.ipv4.tcp_fastopen=3"); err != nil {
					return err
				}
			}
			tfo := Sock{Proto: "tcp", Family: 4, FastOpen: true}
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port), FastOpen: true}})
			if err != nil {
				return err
			}
			if _, err := e.Sink(r, e.A.Name, Attacker, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), e.Port+1), FastOpen: true}}); err != nil {
				return err
			}
			// Cookies first (data after the handshake); bob's from a
			// listener of his own on the same node.
			for _, u := range []string{Attacker, Victim} {
				port := e.Port + 1
				if u == Victim {
					port = e.Port
				}
				if _, err := e.Act(e.B.Name, u, ActSpec{Sock: tfo, Dst: ap(e.A.Eth0V4, port), Nonce: newNonce()}); err != nil {
					return err
				}
			}
			to := ap(e.A.Eth0V4, e.Port)
			r.Attack(e, s, e.B.Name, Attacker, "TFO SYN + 1460 bytes → "+to, ActSpec{Sock: tfo, Dst: to, Size: 1460})
			r.Control(e, s, e.B.Name, Victim, "TFO SYN + 1460 bytes → "+to, ActSpec{Sock: tfo, Dst: to, Size: 1460})
			return nil
		}}
}
