package dns

import (
	"net"
	"net/netip"
	"testing"

	"github.com/miekg/dns"
)

// recorder is a dns.ResponseWriter that keeps what is written.
type recorder struct {
	dns.ResponseWriter
	msgs []*dns.Msg
}

func (w *recorder) WriteMsg(m *dns.Msg) error { w.msgs = append(w.msgs, m); return nil }
func (w *recorder) RemoteAddr() net.Addr {
	return &net.UDPAddr{IP: net.IPv4(100, 64, 0, 2), Port: 5353}
}

var leased = netip.MustParseAddr("100.64.0.2")

func responder() *Responder {
	return &Responder{Domain: "egress.palisade.", Lookup: func(l string) (netip.Addr, bool) {
		return leased, l == "alice-1-node1"
	}}
}

// TestLocal: overlay names resolve from the lease table, others are
// NXDOMAIN, and with no upstream the rest is refused.
func TestLocal(t *testing.T) {
	for name, want := range map[string]int{
		"alice-1-node1.egress.palisade.":   dns.RcodeSuccess,
		"ALICE-1-NODE1.Egress.Palisade.":   dns.RcodeSuccess,
		"bob-1-node1.egress.palisade.":     dns.RcodeNameError,
		"x.alice-1-node1.egress.palisade.": dns.RcodeNameError,
		"example.org.":                     dns.RcodeRefused,
	} {
		q := new(dns.Msg)
		q.SetQuestion(name, dns.TypeA)
		w := &recorder{}
		responder().ServeDNS(w, q)
		if len(w.msgs) != 1 || w.msgs[0].Rcode != want {
			t.Fatalf("%s: %v, want rcode %d", name, w.msgs, want)
		}
		if want == dns.RcodeSuccess {
			if a, ok := w.msgs[0].Answer[0].(*dns.A); !ok || !a.A.Equal(net.IP(leased.AsSlice())) {
				t.Fatalf("%s: answer %v", name, w.msgs[0].Answer)
			}
		}
	}
}

// FuzzServeDNS: the gateway's resolver reads queries from every client.
// Whatever parses gets exactly one answer that packs, and only the leased
// name is answered with the lease's address.
func FuzzServeDNS(f *testing.F) {
	for _, n := range []string{"alice-1-node1.egress.palisade.", "egress.palisade.", "example.org."} {
		for _, qt := range []uint16{dns.TypeA, dns.TypeAAAA, dns.TypeANY} {
			q := new(dns.Msg)
			q.SetQuestion(n, qt)
			b, err := q.Pack()
			if err != nil {
				f.Fatal(err)
			}
			f.Add(b)
		}
	}
	f.Add([]byte{0, 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		q := new(dns.Msg)
		if q.Unpack(b) != nil {
			return
		}
		w := &recorder{}
		responder().ServeDNS(w, q)
		if len(w.msgs) != 1 {
			t.Fatalf("%d answers", len(w.msgs))
		}
		m := w.msgs[0]
		if _, err := m.Pack(); err != nil {
			t.Fatalf("answer does not pack: %v\n%v", err, m)
		}
		for _, rr := range m.Answer {
			if a, ok := rr.(*dns.A); ok && a.A.Equal(net.IP(leased.AsSlice())) &&
				!equalFold(q.Question[0].Name, "alice-1-node1.egress.palisade.") {
				t.Fatalf("lease address given for %q", q.Question[0].Name)
			}
		}
	})
}

func equalFold(a, b string) bool { return dns.CanonicalName(a) == dns.CanonicalName(b) }
