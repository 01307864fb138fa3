package attack

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
	uwlab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// ChurnOptions shape a churn run.
type ChurnOptions struct {
	// Duration of traffic and disruptions (default 10 minutes).
	Duration time.Duration
	// Every is the pause between two disruptions (default 3 s).
	Every time.Duration
	// Kinds are the disruptions to cycle through (default all:
	// sigterm, reload, sigkill, nft-flush, addr-add).
	Kinds []string
	// Log receives progress lines; nil = quiet.
	Log func(format string, args ...any)
}

// allKinds are the disruptions a churn cycles through.
var allKinds = []string{"sigterm", "reload", "sigkill", "nft-flush", "addr-add"}

// StreamStat counts one traffic stream.
type StreamStat struct {
	Name      string
	Attack    bool
	Sent      int // attempts
	Delivered int // nonces the victim's socket received
	Errnos    map[string]int
}

// ChurnReport is what a churn run saw.
type ChurnReport struct {
	Duration    time.Duration
	Disruptions map[string]int
	Streams     []*StreamStat
	// Leaks are the attack payloads that arrived: stream, nonce, when
	// (relative to the start) and the disruption in force.
	Leaks []string
	// Errors are disruptions that failed (an agent that did not restart…).
	Errors []string
}

// Totals sums the streams.
func (r *ChurnReport) Totals() (legitSent, legitOK, attackSent, attackOK int) {
	for _, s := range r.Streams {
		if s.Attack {
			attackSent += s.Sent
			attackOK += s.Delivered
		} else {
			legitSent += s.Sent
			legitOK += s.Delivered
		}
	}
	return
}

// Write prints the report; the last line is "N passed, M failed" where a
// failure is a delivered attack, a disruption that failed, or no
// legitimate traffic at all (a broken harness).
func (r *ChurnReport) Write(w io.Writer) (failed int) {
	ls, lok, as, aok := r.Totals()
	var ds []string
	for k, v := range r.Disruptions {
		ds = append(ds, fmt.Sprintf("%s %d", k, v))
	}
	sort.Strings(ds)
	fmt.Fprintf(w, "churn: %v of traffic; disruptions: %s\n", r.Duration.Round(time.Second), strings.Join(ds, ", "))
	for _, s := range r.Streams {
		kind := "legit "
		if s.Attack {
			kind = "attack"
		}
		var es []string
		for k, v := range s.Errnos {
			es = append(es, fmt.Sprintf("%s %d", k, v))
		}
		sort.Strings(es)
		fmt.Fprintf(w, "  %s %-28s %5d sent, %5d delivered  %s\n", kind, s.Name, s.Sent, s.Delivered, strings.Join(es, ", "))
	}
	rate := 0.0
	if ls > 0 {
		rate = 100 * float64(lok) / float64(ls)
	}
	fmt.Fprintf(w, "legitimate: %d/%d delivered (%.2f %%)\n", lok, ls, rate)
	fmt.Fprintf(w, "attacks:    %d/%d delivered\n", aok, as)
	for i, l := range r.Leaks {
		if i == 20 {
			fmt.Fprintf(w, "  … and %d more\n", len(r.Leaks)-i)
			break
		}
		fmt.Fprintf(w, "  LEAK %s\n", l)
	}
	for _, e := range r.Errors {
		fmt.Fprintf(w, "  ERROR %s\n", e)
	}
	failed = aok + len(r.Errors)
	if lok == 0 {
		failed++
	}
	fmt.Fprintf(w, "%d passed, %d failed\n", as-aok+lok, failed)
	return failed
}

type stream struct {
	name, node, user string
	attack           bool
	sink             *Sink
	spec             ActSpec
	stat             *StreamStat
	sent             map[string]time.Time // nonce → sent (from the act's lines)
}

// Churn runs continuous legitimate traffic (alice → alice) and continuous
// attacks (bob → alice), local and across nodes, TCP and UDP, v4 and v6,
// while it restarts node agents (SIGTERM, SIGKILL), reloads them (SIGHUP),
// flushes their nft ruleset and adds addresses to eth0 — one disruption
// every opts.Every, cycling through nodes A and B. Bounded by Duration;
// everything it changed is restored at the end.
func Churn(ctx context.Context, tb *testbed.Testbed, opts ChurnOptions) (*ChurnReport, error) {
	if len(tb.Nodes) < 2 {
		return nil, errors.New("churn needs at least 2 nodes")
	}
	if opts.Duration <= 0 {
		opts.Duration = 10 * time.Minute
	}
	if opts.Every <= 0 {
		opts.Every = 3 * time.Second
	}
	for _, k := range opts.Kinds {
		if !slices.Contains(allKinds, k) {
			return nil, fmt.Errorf("unknown disruption %q (known: %v)", k, allKinds)
		}
	}
	logf := opts.Log
	if logf == nil {
		logf = func(string, ...any) {}
	}
	e := &Env{TB: tb, Ctx: ctx, A: tb.Nodes[0], B: tb.Nodes[1], Outside: tb.Outside, Port: 43000, Log: logf, ll: map[string]netip.Addr{}}
	r := &Run{}
	defer func() {
		for _, s := range r.sinks {
			s.stop()
		}
		for i := len(r.cleanup) - 1; i >= 0; i-- {
			r.cleanup[i]()
		}
	}()
	p := e.Port
	mk := func(proto string, fam, port int) (*Sink, error) {
		return e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: proto, Family: fam, Bind: ap(wild(fam), port)}})
	}
	tcp4, err := mk("tcp", 4, p)
	if err != nil {
		return nil, err
	}
	udp4, err := mk("udp", 4, p+1)
	if err != nil {
		return nil, err
	}
	udp6, err := mk("udp", 6, p+2)
	if err != nil {
		return nil, err
	}
	type flow struct {
		name  string
		local bool
		sink  *Sink
		spec  ActSpec
	}
	flows := []flow{
		{"cross-tcp4", false, tcp4, ActSpec{Sock: sock("tcp", 4), Dst: ap(e.A.Eth0V4, p)}},
		{"cross-udp4", false, udp4, ActSpec{Sock: sock("udp", 4), Dst: ap(e.A.Eth0V4, p+1), Connect: true}},
		{"cross-udp6", false, udp6, ActSpec{Sock: sock("udp", 6), Dst: ap(e.A.Eth0V6, p+2)}},
		{"local-tcp4", true, tcp4, ActSpec{Sock: sock("tcp", 4), Dst: ap(lo(4), p)}},
		{"local-udp4", true, udp4, ActSpec{Sock: sock("udp", 4), Dst: ap(e.A.Eth0V4, p+1)}},
	}
	var streams []*stream
	for _, f := range flows {
		for _, user := range []string{Victim, Attacker} {
			node := e.B.Name
			if f.local {
				node = e.A.Name
			}
			st := &stream{name: f.name + " " + user, node: node, user: user, attack: user == Attacker, sink: f.sink,
				spec: f.spec, sent: map[string]time.Time{}}
			st.stat = &StreamStat{Name: st.name, Attack: st.attack, Errnos: map[string]int{}}
			st.spec.Nonce = newNonce()
			st.spec.LoopMS = int(opts.Duration / time.Millisecond)
			st.spec.WaitMS = 1000
			streams = append(streams, st)
		}
	}
	t0 := time.Now()
	var wg sync.WaitGroup
	for _, st := range streams {
		b, _ := json.Marshal(st.spec)
		cmd := e.TB.Command(ctx, st.node, asUser(st.user), e.TB.LabBinary, "probe", "act", "--spec", string(b))
		out, err := cmd.StdoutPipe()
		if err != nil {
			return nil, err
		}
		if err := cmd.Start(); err != nil {
			return nil, err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				var l LoopLine
				if json.Unmarshal(sc.Bytes(), &l) != nil {
					continue
				}
				st.sent[l.Nonce] = time.Now()
				st.stat.Sent++
				if !l.OK {
					st.stat.Errnos[l.Errno]++
				}
			}
			cmd.Wait()
		}()
	}
	logf("churn: %d streams for %v", len(streams), opts.Duration)

	rep := &ChurnReport{Disruptions: map[string]int{}}
	// What was in force when, to name a leak's circumstances.
	type event struct {
		at   time.Time
		what string
	}
	var events []event
	nodes := []testbed.Node{e.A, e.B}
	kinds := opts.Kinds
	if len(kinds) == 0 {
		kinds = allKinds
	}
	var added []string
	end := t0.Add(opts.Duration)
	for i := 0; time.Now().Add(opts.Every).Before(end) && ctx.Err() == nil; i++ {
		select {
		case <-time.After(opts.Every):
		case <-ctx.Done():
		}
		n := nodes[(i/len(kinds))%2]
		kind := kinds[i%len(kinds)]
		var err error
		switch kind {
		case "sigterm", "sigkill":
			sig := syscall.SIGTERM
			if kind == "sigkill" {
				sig = syscall.SIGKILL
			}
			err = e.restartAgent(n, sig)
		case "reload":
			if pid := control.ReadPid(uwlab.AgentPidFile(tb, n.Name)); pid != 0 {
				err = syscall.Kill(pid, syscall.SIGHUP)
			} else {
				err = errors.New("no agent")
			}
		case "nft-flush":
			_, err = e.Root(n.Name, "nft", "flush", "ruleset")
		case "addr-add":
			a := fmt.Sprintf("198.18.0.%d/24", 200+len(added)%50)
			if _, err = e.Root(n.Name, "ip", "addr", "add", a, "dev", "eth0"); err == nil {
				added = append(added, n.Name+" "+a)
			}
		default:
			err = fmt.Errorf("unknown disruption %q", kind)
		}
		what := kind + "@" + n.Name
		events = append(events, event{time.Now(), what})
		rep.Disruptions[kind]++
		if err != nil {
			rep.Errors = append(rep.Errors, fmt.Sprintf("%v %s: %v", time.Since(t0).Round(time.Millisecond), what, err))
		}
		logf("churn: %v %s", time.Since(t0).Round(time.Second), what)
	}
	wg.Wait()
	rep.Duration = time.Since(t0)
	time.Sleep(Grace)
	for _, st := range streams {
		for nonce, at := range st.sent {
			if !st.sink.Got(nonce, 0) {
				continue
			}
			st.stat.Delivered++
			if st.attack {
				last := "none yet"
				for _, ev := range events {
					if ev.at.Before(at) {
						last = fmt.Sprintf("%s %v before", ev.what, at.Sub(ev.at).Round(time.Millisecond))
					}
				}
				rep.Leaks = append(rep.Leaks, fmt.Sprintf("%s at %v (last disruption: %s)", st.name,
					at.Sub(t0).Round(time.Millisecond), last))
			}
		}
		rep.Streams = append(rep.Streams, st.stat)
	}
	sort.Strings(rep.Leaks)
	for _, a := range added {
		node, addr, _ := strings.Cut(a, " ")
		e.Root(node, "ip", "addr", "del", addr, "dev", "eth0")
	}
	for _, n := range nodes {
		if err := e.restoreAgent(n); err != nil {
			rep.Errors = append(rep.Errors, fmt.Sprintf("restore agent on %s: %v", n.Name, err))
		}
	}
	return rep, nil
}

// restartAgent stops node's agent with sig and starts it again.
func (e *Env) restartAgent(n testbed.Node, sig syscall.Signal) error {
	if err := uwlab.SignalAgent(e.TB, n.Name, sig); err != nil {
		return err
	}
	return uwlab.StartAgent(e.Ctx, e.TB, n)
}
