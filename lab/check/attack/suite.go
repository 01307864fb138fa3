package attack

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Case is one attack with its control.
type Case struct {
	Name  string // unique, e.g. "udp-reply-stolen-port-cross-v4"
	Class string // what the issue calls it: "udp-reply", "multicast", …
	Why   string // one line: what the attacker tries and why it should fail
	Run   func(e *Env, r *Run) error
}

// Env is the running testbed as the cases see it.
type Env struct {
	TB      *testbed.Testbed
	Ctx     context.Context
	A, B    testbed.Node // A: the victim's node; B: another node
	Outside testbed.Node
	// Port is the first of the ports this case may use (10 per case).
	Port int
	Log  func(format string, args ...any)
	ll   map[string]netip.Addr // link-local address of eth0 per node
	// present: "node/user" has a process for the whole suite.
	present map[string]bool
	// actors: one step-running process per node and user (nil: a
	// process per step).
	actors *actors
}

// Sink is a running victim socket.
type Sink struct {
	Node, User string
	Spec       SinkSpec
	Addr       string // bound address (from the ready line)
	cmd        *exec.Cmd
	stdin      io.WriteCloser
	mu         sync.Mutex
	got        map[string]string // nonce → from
	cond       chan struct{}     // closed and replaced on every new nonce
}

// Step is one attack or control step and what came of it.
type Step struct {
	Sink      *Sink
	Node      string
	User      string
	Desc      string
	Nonce     string
	Res       ActResult
	Delivered bool
	Evidence  string // for cases that judge delivery themselves (SYN_RECV)
}

// Run collects a case's steps.
type Run struct {
	Attacks, Controls []*Step
	NA                string // not applicable on this kernel / machine, and why
	Notes             []string
	sinks             []*Sink
	cleanup           []func()
	errs              []error
}

// Result is one case's outcome.
type Result struct {
	Case     *Case
	Pass     bool
	NA       string
	Err      error
	Attacks  []*Step
	Controls []*Step
	Notes    []string
	Elapsed  time.Duration
}

// Users' identities in the testbed (testbed.Users): the victim alice, the
// attacker bob.
const (
	Victim      = "alice"
	Attacker    = "bob"
	victimUID   = 2001
	attackerUID = 2002
)

func newNonce() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func asUser(u string) string {
	if u == "root" {
		return ""
	}
	return u
}

// Sink starts a victim socket as user on node and waits until it is bound.
func (e *Env) Sink(r *Run, node, user string, spec SinkSpec) (*Sink, error) {
	return e.SinkGated(r, node, user, spec, nil)
}

// SinkGated is Sink for a Gated spec: between runs once the socket exists
// and before it is bound or sends (nil: not gated).
func (e *Env) SinkGated(r *Run, node, user string, spec SinkSpec, between func() error) (*Sink, error) {
	spec.Gated = between != nil
	b, _ := json.Marshal(spec)
	cmd := e.command(e.Ctx, node, user, e.TB.LabBinary, "probe", "sink", "--spec", string(b))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	cmd.WaitDelay = 2 * time.Second
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	s := &Sink{Node: node, User: user, Spec: spec, cmd: cmd, stdin: stdin, got: map[string]string{}, cond: make(chan struct{})}
	r.sinks = append(r.sinks, s)
	ready := make(chan SinkLine, 1)
	created := make(chan struct{}, 1)
	go func() {
		sc := bufio.NewScanner(out)
		first := true
		for sc.Scan() {
			var l SinkLine
			if json.Unmarshal(sc.Bytes(), &l) != nil {
				continue
			}
			if l.Type == "created" {
				created <- struct{}{}
				continue
			}
			if first {
				ready <- l
				first = false
				continue
			}
			if l.Type == "got" {
				s.mu.Lock()
				if _, ok := s.got[l.Nonce]; !ok {
					s.got[l.Nonce] = l.From
					close(s.cond)
					s.cond = make(chan struct{})
				}
				s.mu.Unlock()
			}
		}
		if first {
			ready <- SinkLine{Type: "error", Error: "exited: " + strings.TrimSpace(stderr.String())}
		}
	}()
	if between != nil {
		select {
		case <-created:
		case l := <-ready:
			return s, &SinkError{Errno: l.Errno, Msg: fmt.Sprintf("sink %s@%s %s: %s", user, node, spec.Proto, l.Error)}
		case <-time.After(patient(15 * time.Second)):
			return s, fmt.Errorf("sink %s@%s: socket not created after %v", user, node, patient(15*time.Second))
		}
		if err := between(); err != nil {
			return s, err
		}
		if _, err := io.WriteString(stdin, "go\n"); err != nil {
			return s, err
		}
	}
	select {
	case l := <-ready:
		if l.Type != "ready" {
			return s, &SinkError{Errno: l.Errno, Msg: fmt.Sprintf("sink %s@%s %s: %s", user, node, spec.Proto, l.Error)}
		}
		s.Addr = l.Addr
		return s, nil
	case <-time.After(patient(15 * time.Second)):
		return s, fmt.Errorf("sink %s@%s: not ready after %v", user, node, patient(15*time.Second))
	case <-e.Ctx.Done():
		return s, e.Ctx.Err()
	}
}

// SinkError is a sink that could not bind (Errno tells why).
type SinkError struct {
	Errno string
	Msg   string
}

func (e *SinkError) Error() string { return e.Msg }

func (s *Sink) stop() {
	s.stdin.Close()
	done := make(chan struct{})
	go func() { s.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		s.cmd.Process.Kill()
		<-done
	}
}

// Got reports whether nonce arrived, waiting at most d for it.
func (s *Sink) Got(nonce string, d time.Duration) bool {
	deadline := time.After(d)
	for {
		s.mu.Lock()
		_, ok := s.got[nonce]
		c := s.cond
		s.mu.Unlock()
		if ok {
			return true
		}
		select {
		case <-c:
		case <-deadline:
			return false
		}
	}
}

// From is where nonce came from ("" if it did not arrive).
func (s *Sink) From(nonce string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.got[nonce]
}

// command is TB.Command for a step's user, who may be written
// "unshare:FLAGS:user" (argv runs inside `unshare FLAGS`) or "stray:UID"
// (argv runs as that uid outside any session, as cron, at or systemd
// --user would start it: root's setpriv, no login, so in uvn in no VRF).
func (e *Env) command(ctx context.Context, node, user string, argv ...string) *exec.Cmd {
	if rest, ok := strings.CutPrefix(user, "unshare:"); ok {
		flags, u, _ := strings.Cut(rest, ":")
		user = u
		argv = append([]string{"unshare", flags, "--"}, argv...)
	}
	if uid, ok := strings.CutPrefix(user, "stray:"); ok {
		user = "root"
		argv = append([]string{"setpriv", "--reuid=" + uid, "--regid=" + uid, "--init-groups", "--"}, argv...)
	}
	return e.TB.Command(ctx, node, asUser(user), argv...)
}

// inVM reports a run inside the uvn VM (its guest agent sets
// PALISADE_VM=1): every process start there is seconds under emulation, so
// the suite is patient, never lenient (as check's matrix, docs/check.md).
func inVM() bool { return os.Getenv("PALISADE_VM") == "1" }

func patient(d time.Duration) time.Duration {
	if inVM() {
		return 10 * d
	}
	return d
}

// Act runs one step as user on node (see command for the user's forms).
func (e *Env) Act(node, user string, spec ActSpec) (ActResult, error) {
	// A step that takes other ids (Creds) keeps them: its own process.
	if e.actors != nil && pooled(user) && spec.Creds == nil {
		return e.actors.act(e, node, user, spec, patient(20*time.Second))
	}
	b, _ := json.Marshal(spec)
	ctx, cancel := context.WithTimeout(e.Ctx, patient(20*time.Second))
	defer cancel()
	cmd := e.command(ctx, node, user, e.TB.LabBinary, "probe", "act", "--spec", string(b))
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var res ActResult
	if jerr := json.Unmarshal(out, &res); jerr != nil {
		return res, fmt.Errorf("act %s@%s: %v: %s %s", user, node, err, out, strings.TrimSpace(stderr.String()))
	}
	return res, nil
}

func (r *Run) step(e *Env, list *[]*Step, s *Sink, node, user, desc string, spec ActSpec) *Step {
	spec.Nonce = newNonce()
	st := &Step{Sink: s, Node: node, User: user, Desc: desc, Nonce: spec.Nonce}
	*list = append(*list, st)
	res, err := e.Act(node, user, spec)
	st.Res = res
	if err != nil {
		r.errs = append(r.errs, err)
	}
	return st
}

// Attack runs an attacker step aimed at sink s (a step that could not run
// at all is an error of the case).
func (r *Run) Attack(e *Env, s *Sink, node, user, desc string, spec ActSpec) *Step {
	return r.step(e, &r.Attacks, s, node, user, desc, spec)
}

// Control runs the rightful user's step on the same path.
func (r *Run) Control(e *Env, s *Sink, node, user, desc string, spec ActSpec) *Step {
	return r.step(e, &r.Controls, s, node, user, desc, spec)
}

// Judged records a step whose delivery the case established itself (e.g. a
// spoofed SYN, visible only as a request socket on the victim's node).
func (r *Run) Judged(attack bool, node, user, desc string, delivered bool, evidence string) {
	st := &Step{Node: node, User: user, Desc: desc, Delivered: delivered, Evidence: evidence}
	if attack {
		r.Attacks = append(r.Attacks, st)
	} else {
		r.Controls = append(r.Controls, st)
	}
}

// Note adds a line to the case's report.
func (r *Run) Note(format string, args ...any) {
	r.Notes = append(r.Notes, fmt.Sprintf(format, args...))
}

// Defer runs f when the case ends (restore what the case changed).
func (r *Run) Defer(f func()) { r.cleanup = append(r.cleanup, f) }

// Root runs argv as root on node and returns its combined output.
func (e *Env) Root(node string, argv ...string) (string, error) {
	ctx, cancel := context.WithTimeout(e.Ctx, patient(20*time.Second))
	defer cancel()
	out, err := e.TB.Output(ctx, node, "", argv...)
	if err != nil {
		return out, fmt.Errorf("%s on %s: %v: %s", strings.Join(argv, " "), node, err, strings.TrimSpace(out))
	}
	return out, nil
}

// LinkLocal is node's eth0 link-local IPv6 address (with zone eth0).
func (e *Env) LinkLocal(node string) (netip.Addr, error) {
	if a, ok := e.ll[node]; ok {
		return a, nil
	}
	out, err := e.Root(node, "ip", "-6", "-o", "addr", "show", "dev", "eth0", "scope", "link")
	if err != nil {
		return netip.Addr{}, err
	}
	for _, f := range strings.Fields(out) {
		if p, err := netip.ParsePrefix(f); err == nil && p.Addr().IsLinkLocalUnicast() {
			a := p.Addr().WithZone("eth0")
			e.ll[node] = a
			return a, nil
		}
	}
	return netip.Addr{}, fmt.Errorf("%s: no link-local address on eth0", node)
}

// Grace is how long an attack gets to arrive once its case's controls
// (sent after it on the same path) have arrived: packets of one path are not
// reordered, so this only covers different sending processes' scheduling.
const Grace = 300 * time.Millisecond

// controlWait bounds the wait for a control's payload.
const controlWait = 3 * time.Second

// Options select the suite's cases.
type Options struct {
	// Only runs the cases whose name contains one of these strings.
	Only []string
	// Log receives a line per case as it ends; nil = quiet.
	Log func(format string, args ...any)
	// BasePort is the first port cases use (default 20000: below the
	// kernel's ephemeral range, 32768-60999, so that no connection a node
	// made itself — an earlier case's client, now in TIME_WAIT, or a
	// daemon's — holds a port a case's listener must bind: CI run ci4 lost
	// a case to "bind: address already in use" at 42xxx).
	BasePort int
	// Mode picks the case set: "userwall" (default: Cases) or "uvn"
	// (UVNCases, in the uvn VM).
	Mode string
	// Actors runs each user's steps in one long-lived process per node
	// (`probe act --serve`) instead of a process per step.
	Actors bool
	// KernelDependent runs only the userwall cases whose outcome can
	// depend on the kernel version (KernelDependent; lab/kernels on the
	// other kernels).
	KernelDependent bool
}

// CasesFor is the case set of a mode, or an error for a mode without one.
func CasesFor(mode string) ([]*Case, error) {
	switch mode {
	case "", "userwall":
		return Cases(), nil
	case "uvn":
		return UVNCases(), nil
	}
	return nil, fmt.Errorf("no attack suite for mode %q (userwall, uvn)", mode)
}

// RunSuite runs every case of opts.Mode on tb (a testbed of that mode with
// at least two nodes), one after the other.
func RunSuite(ctx context.Context, tb *testbed.Testbed, opts Options) ([]*Result, error) {
	if len(tb.Nodes) < 2 {
		return nil, errors.New("the attack suite needs at least 2 nodes")
	}
	cases, err := CasesFor(opts.Mode)
	if err != nil {
		return nil, err
	}
	if opts.KernelDependent && opts.Mode == "uvn" {
		return nil, errors.New("the kernel-dependent selection is userwall's (uvn runs its whole set in its VM)")
	}
	if opts.BasePort == 0 {
		opts.BasePort = 20000
	}
	logf := opts.Log
	if logf == nil {
		logf = func(string, ...any) {}
	}
	// uvn: alice and bob keep a process on B for the whole suite, so that
	// their networks (VRF, VXLANs, NAT address) exist there for the
	// cross-node cases without a process start per case.
	present := map[string]bool{}
	var acts *actors
	if opts.Actors {
		acts = newActors(ctx)
		defer acts.close()
	}
	if opts.Mode == "uvn" {
		hold := &Run{}
		defer func() {
			for _, s := range hold.sinks {
				s.stop()
			}
		}()
		pe := &Env{TB: tb, Ctx: ctx, A: tb.Nodes[0], B: tb.Nodes[1], Outside: tb.Outside, Log: logf, ll: map[string]netip.Addr{}}
		for i, u := range []string{Victim, Attacker} {
			spec := SinkSpec{Sock: Sock{Proto: "udp", Family: 4, Bind: ap(wild(4), opts.BasePort-10+i)}}
			if _, err := pe.Sink(hold, pe.B.Name, u, spec); err != nil {
				return nil, fmt.Errorf("%s's process on %s: %w", u, pe.B.Name, err)
			}
			present[pe.B.Name+"/"+u] = true
		}
	}
	var out []*Result
	for i, c := range cases {
		if len(opts.Only) > 0 && !slices.ContainsFunc(opts.Only, func(s string) bool { return strings.Contains(c.Name, s) }) {
			continue
		}
		if opts.KernelDependent && !KernelDependent(c.Name) {
			continue
		}
		if ctx.Err() != nil {
			break
		}
		e := &Env{TB: tb, Ctx: ctx, A: tb.Nodes[0], B: tb.Nodes[1], Outside: tb.Outside,
			Port: opts.BasePort + 10*i, Log: logf, ll: map[string]netip.Addr{}, present: present, actors: acts}
		res := RunCase(e, c)
		out = append(out, res)
		logf("%s", res.Line())
	}
	return out, nil
}

// RunCase runs one case and judges it.
func RunCase(e *Env, c *Case) *Result {
	t0 := time.Now()
	r := &Run{}
	err := errors.Join(append([]error{c.Run(e, r)}, r.errs...)...)
	// Controls first: their arrival acknowledges the path; attacks then
	// get Grace.
	for _, st := range r.Controls {
		if st.Sink != nil {
			st.Delivered = st.Sink.Got(st.Nonce, patient(controlWait))
		}
	}
	if len(r.Attacks) > 0 {
		time.Sleep(patient(Grace))
	}
	for _, st := range r.Attacks {
		if st.Sink != nil {
			st.Delivered = st.Sink.Got(st.Nonce, 0)
		}
	}
	for _, s := range r.sinks {
		s.stop()
	}
	for i := len(r.cleanup) - 1; i >= 0; i-- {
		r.cleanup[i]()
	}
	res := &Result{Case: c, Err: err, NA: r.NA, Attacks: r.Attacks, Controls: r.Controls, Notes: r.Notes,
		Elapsed: time.Since(t0)}
	if res.NA != "" {
		return res
	}
	res.Pass = err == nil && len(r.Attacks) > 0 && len(r.Controls) > 0
	for _, st := range r.Attacks {
		if st.Delivered {
			res.Pass = false
		}
	}
	for _, st := range r.Controls {
		if !st.Delivered {
			res.Pass = false
		}
	}
	return res
}

func (st *Step) outcome() string {
	var w []string
	if st.Delivered {
		w = append(w, "DELIVERED")
		if st.Sink != nil {
			if f := st.Sink.From(st.Nonce); f != "" {
				w = append(w, "from "+f)
			}
		}
	} else {
		w = append(w, "not delivered")
	}
	if st.Evidence != "" {
		w = append(w, "("+st.Evidence+")")
	}
	if !st.Res.OK && st.Res.Error != "" {
		w = append(w, "["+st.Res.Error+"]")
	}
	return strings.Join(w, " ")
}

// Status is PASS, FAIL or N/A.
func (res *Result) Status() string {
	switch {
	case res.NA != "":
		return "N/A"
	case res.Pass:
		return "PASS"
	}
	return "FAIL"
}

// Line is the one-line summary of a case.
func (res *Result) Line() string {
	return fmt.Sprintf("%-4s %-34s %s", res.Status(), res.Case.Name, res.Summary())
}

// Summary says why the case passed or failed in a few words.
func (res *Result) Summary() string {
	if res.NA != "" {
		return "not applicable: " + res.NA
	}
	var w []string
	if res.Err != nil {
		w = append(w, "error: "+res.Err.Error())
	}
	if len(res.Attacks) == 0 && res.Err == nil {
		w = append(w, "no attack step ran")
	}
	if len(res.Controls) == 0 && res.Err == nil {
		w = append(w, "no control step ran")
	}
	for _, st := range res.Attacks {
		if st.Delivered {
			w = append(w, "attack delivered: "+st.Desc+" → "+st.outcome())
		}
	}
	for _, st := range res.Controls {
		if !st.Delivered {
			w = append(w, "control NOT delivered: "+st.Desc+" → "+st.outcome())
		}
	}
	if len(w) == 0 {
		return fmt.Sprintf("%d attack steps delivered nothing, %d controls delivered (%v)", len(res.Attacks),
			len(res.Controls), res.Elapsed.Round(10*time.Millisecond))
	}
	return strings.Join(w, "; ")
}

// WriteReport prints every case (rationale, steps) and the summary lines;
// the last line is "N passed, M failed".
func WriteReport(w io.Writer, results []*Result, verbose bool) (passed, failed, na int) {
	for _, res := range results {
		fmt.Fprintln(w, res.Line())
		if verbose || res.Status() == "FAIL" {
			fmt.Fprintf(w, "       why: %s\n", res.Case.Why)
			for _, st := range res.Attacks {
				fmt.Fprintf(w, "       attack  %s@%s %s: %s\n", st.User, st.Node, st.Desc, st.outcome())
			}
			for _, st := range res.Controls {
				fmt.Fprintf(w, "       control %s@%s %s: %s\n", st.User, st.Node, st.Desc, st.outcome())
			}
			for _, n := range res.Notes {
				fmt.Fprintf(w, "       note: %s\n", n)
			}
		}
		switch res.Status() {
		case "PASS":
			passed++
		case "FAIL":
			failed++
		default:
			na++
		}
	}
	if na > 0 {
		fmt.Fprintf(w, "%d not applicable on this kernel/machine (not counted)\n", na)
	}
	fmt.Fprintf(w, "%d passed, %d failed\n", passed, failed)
	return
}

func ap(a netip.Addr, port int) string { return netip.AddrPortFrom(a, uint16(port)).String() }

func itoa(i int) string { return strconv.Itoa(i) }
