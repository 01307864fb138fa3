// Package dns is the gateway's resolver for egress clients: names of the
// overlay (<user>-<job>-<node>.<domain>) are answered from the lease table,
// everything else is forwarded to the configured upstream server.
package dns

import (
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// Responder answers overlay names and forwards the rest.
type Responder struct {
	// Domain is the overlay zone, e.g. "egress.palisade." (fully qualified).
	Domain string
	// Lookup maps an overlay label (user-job-node) to its address.
	Lookup func(label string) (netip.Addr, bool)
	// Upstream is host:port of the resolver for other names ("" = refuse).
	Upstream string
	client   dns.Client
}

// ServeDNS implements dns.Handler.
func (r *Responder) ServeDNS(w dns.ResponseWriter, q *dns.Msg) {
	if len(q.Question) != 1 {
		m := new(dns.Msg)
		m.SetRcode(q, dns.RcodeFormatError)
		w.WriteMsg(m)
		return
	}
	name := strings.ToLower(q.Question[0].Name)
	zone := dns.Fqdn(strings.ToLower(r.Domain))
	if name == zone || strings.HasSuffix(name, "."+zone) {
		w.WriteMsg(r.local(q, strings.TrimSuffix(strings.TrimSuffix(name, zone), ".")))
		return
	}
	if r.Upstream == "" {
		m := new(dns.Msg)
		m.SetRcode(q, dns.RcodeRefused)
		w.WriteMsg(m)
		return
	}
	c := r.client
	if c.Timeout == 0 {
		c.Timeout = 3 * time.Second
	}
	if _, ok := w.RemoteAddr().(*net.TCPAddr); ok {
		c.Net = "tcp"
	}
	ans, _, err := c.Exchange(q, r.Upstream)
	if err != nil {
		m := new(dns.Msg)
		m.SetRcode(q, dns.RcodeServerFailure)
		w.WriteMsg(m)
		return
	}
	w.WriteMsg(ans)
}

func (r *Responder) local(q *dns.Msg, label string) *dns.Msg {
	m := new(dns.Msg)
	m.SetReply(q)
	m.Authoritative = true
	a, ok := netip.Addr{}, false
	if label != "" && !strings.Contains(label, ".") {
		a, ok = r.Lookup(label)
	}
	if !ok {
		m.Rcode = dns.RcodeNameError
		m.Ns = []dns.RR{r.soa()}
		return m
	}
	qt := q.Question[0].Qtype
	if a.Is4() && (qt == dns.TypeA || qt == dns.TypeANY) {
		m.Answer = append(m.Answer, &dns.A{
			Hdr: dns.RR_Header{Name: q.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 30},
			A:   net.IP(a.AsSlice()),
		})
	}
	if len(m.Answer) == 0 {
		m.Ns = []dns.RR{r.soa()} // NODATA
	}
	return m
}

func (r *Responder) soa() dns.RR {
	z := dns.Fqdn(r.Domain)
	return &dns.SOA{
		Hdr: dns.RR_Header{Name: z, Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: 30},
		Ns:  "gateway." + z, Mbox: "hostmaster." + z, Serial: 1, Refresh: 60, Retry: 60, Expire: 60, Minttl: 30,
	}
}

// Serve runs the responder on a packet conn and, if l is non-nil, on a TCP
// listener, until they are closed.
func (r *Responder) Serve(pc net.PacketConn, l net.Listener) {
	var wg sync.WaitGroup
	if l != nil {
		wg.Go(func() { (&dns.Server{Listener: l, Handler: r}).ActivateAndServe() })
	}
	(&dns.Server{PacketConn: pc, Handler: r}).ActivateAndServe()
	wg.Wait()
}
