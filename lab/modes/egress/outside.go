// Package lab is the egress part of the testbed (`palisade-lab testbed up
// --egress`): a gateway host and an outside host that only the gateway
// reaches, plus the services the tests and benchmarks talk to.
package egress

import (
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"

	"github.com/miekg/dns"
)

// ServeOutside runs the outside host's services: HTTP (body names the
// client's address as seen outside), an authoritative DNS zone with
// outside.<zone>, and a UDP echo. It serves until killed.
func ServeOutside(args []string) error {
	fs := flag.NewFlagSet("__egress-outside", flag.ContinueOnError)
	httpAddr := fs.String("http", ":80", "HTTP listen address")
	dnsAddr := fs.String("dns", ":53", "DNS listen address")
	echoAddr := fs.String("udp-echo", ":7", "UDP echo listen address")
	zone := fs.String("zone", "pal.test", "DNS zone served")
	self := fs.String("addr", "198.18.201.1", "address of outside.<zone>")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ip := net.ParseIP(*self)
	if ip == nil {
		return fmt.Errorf("--addr %q", *self)
	}
	z := dns.Fqdn(*zone)
	h := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(q)
		if len(q.Question) != 1 || !dns.IsSubDomain(z, strings.ToLower(q.Question[0].Name)) {
			m.Rcode = dns.RcodeRefused
		} else if n := strings.ToLower(q.Question[0].Name); n == "outside."+z && q.Question[0].Qtype == dns.TypeA {
			m.Authoritative = true
			m.Answer = []dns.RR{&dns.A{Hdr: dns.RR_Header{Name: q.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: ip}}
		} else if n != "outside."+z {
			m.Rcode = dns.RcodeNameError
		}
		w.WriteMsg(m)
	})
	pc, err := net.ListenPacket("udp", *dnsAddr)
	if err != nil {
		return err
	}
	go (&dns.Server{PacketConn: pc, Handler: h}).ActivateAndServe()
	ec, err := net.ListenPacket("udp", *echoAddr)
	if err != nil {
		return err
	}
	go func() {
		buf := make([]byte, 65535)
		for {
			n, from, err := ec.ReadFrom(buf)
			if err != nil {
				return
			}
			ec.WriteTo(buf[:n], from)
		}
	}()
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "palisade-outside hello %s\n", r.RemoteAddr)
	})
	mux.HandleFunc("/blob", func(w http.ResponseWriter, r *http.Request) {
		io.CopyN(w, zeros{}, 64<<20)
	})
	return http.ListenAndServe(*httpAddr, mux)
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}
