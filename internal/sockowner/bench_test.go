package sockowner

import (
	"context"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// BenchmarkLookup measures one local lookup of a listener (sock_diag exact
// get, cached inode → pid, /proc/PID/status, cached names) on loopback.
func BenchmarkLookup(b *testing.B) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	ap := netip.MustParseAddrPort(l.Addr().String())
	r, err := NewResolver()
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	for b.Loop() {
		if o, err := r.Lookup(ap, policy.TCP); err != nil || o.PID != os.Getpid() {
			b.Fatalf("%+v %v", o, err)
		}
	}
}

// BenchmarkRemoteQuery measures a full query over UDP between two scratch
// namespaces (bind a privileged port, ask, wait for the answer).
func BenchmarkRemoteQuery(b *testing.B) {
	s := newScratch(b)
	startServer(b, s.nsA, []string{"198.18.77.0/24"}, "")
	var l net.Listener
	in(b, s.nsA, func() {
		var err error
		if l, err = net.Listen("tcp", "198.18.77.1:0"); err != nil {
			b.Fatal(err)
		}
	})
	defer l.Close()
	target := netip.MustParseAddrPort(l.Addr().String())
	cl := Client{Timeout: time.Second, ns: s.nsB, hasNS: true}
	for b.Loop() {
		if _, err := cl.Query(context.Background(), target.Addr(), target, netip.AddrPort{}, policy.TCP); err != nil {
			b.Fatal(err)
		}
	}
}
