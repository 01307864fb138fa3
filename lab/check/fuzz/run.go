package fuzz

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/lab/check"
	"github.com/palisade-hpc/palisade/lab/check/attack"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Options configure a fuzzing run.
type Options struct {
	Duration time.Duration
	Seed     uint64
	// Mode is the expectation the receipts are judged by ("" = the
	// testbed's mode): userwall's is policy.Decide with the listener
	// node's policy.
	Mode string
	// Expect overrides the mode's expectation (tests: a rule taken out of
	// the judge must show up as findings).
	Expect check.Expectation
	// Nodes limits sentinels and attackers to these nodes (default all).
	Nodes []string
	// Minimize delta-debugs at most this many findings (default 3): each
	// takes some dozens of program runs.
	Minimize int
	// StopAfter ends the run after this many findings (0: never).
	StopAfter int
	// Replay runs only this program (a minimal reproduction), once.
	Replay *Program
	// BasePort is the first sentinel port (default 47000).
	BasePort int
	Log      func(format string, args ...any)
}

// Report is a fuzzing run's outcome.
type Report struct {
	Seed    uint64
	Mode    string
	Testbed string
	Nodes   []string
	Elapsed time.Duration
	Rounds  int // programs run as an attacker
	Sends   int // send steps of attackers
	SendsOK int // … that the kernel accepted
	Wraps   map[string]int
	// Errnos counts the attackers' failed calls: "sendto EACCES" → n.
	Errnos   map[string]int
	Protos   []string // sentinel protocols the kernel has
	Missing  []string // sentinel protocols it lacks
	Findings []*Finding
	// Unattributed are bytes without a nonce at a sentinel (none expected:
	// every program sends nonce lines only).
	Unattributed []string
	// Positive control: the same programs as the owner.
	ControlSends, ControlOKSends, ControlDelivered int
	ControlRoundsOK, ControlRoundsReached          int
	// Probes: one plain send of the owner per round to the round's target;
	// every one must arrive.
	Probes      int
	ProbeMisses []string
	Warnings    []string
}

// Finding is an attacker's byte at a sentinel the mode refuses him.
type Finding struct {
	Round   int
	Program *Program
	Leaks   []Leak
	// Minimal is the smallest program found that still leaks (nil: not
	// minimized; equal to Program: nothing could be removed).
	Minimal *Program
	// Reproduced: the minimal program leaked again when run alone.
	Reproduced bool
	Known      string // the known finding it matches (docs/fuzz.md), if any
}

// Leak is one nonce at one sentinel.
type Leak struct {
	Sentinel string `json:"sentinel"`
	Step     int    `json:"step"`
	Peer     bool   `json:"peer,omitempty"`
	From     string `json:"from"`
	Rule     string `json:"rule"` // why the mode refuses it
	// InClusterAllowed: the mode would allow it had the source been the
	// sender node's cluster address (a source the policy core does not
	// trust, such as link-local, is all that refuses it).
	InClusterAllowed bool `json:"in_cluster_allowed,omitempty"`
	// Count is how many times it arrived (GSO segments, fragments' copies,
	// one datagram to several members).
	Count int `json:"count,omitempty"`
}

// Failed reports whether the run found what it must fail on: a leak not
// documented as known, an unattributed byte, or a positive control that
// reached nothing.
func (r *Report) Failed() bool {
	for _, f := range r.Findings {
		if f.Known == "" {
			return true
		}
	}
	return len(r.Unattributed) > 0 || r.controlBroken() != ""
}

// controlBroken says why the positive control failed, or "".
func (r *Report) controlBroken() string {
	switch {
	case r.Probes > 0 && len(r.ProbeMisses) > 0:
		return fmt.Sprintf("%d of %d owner probes did not arrive", len(r.ProbeMisses), r.Probes)
	case r.Rounds > 0 && r.ControlDelivered == 0:
		return "the owner's programs reached no sentinel at all"
	case r.ControlRoundsOK >= 10 && r.ControlRoundsReached*5 < r.ControlRoundsOK:
		return fmt.Sprintf("the owner's programs reached a sentinel in only %d of %d rounds", r.ControlRoundsReached, r.ControlRoundsOK)
	}
	return ""
}

type receipt struct {
	tag, from string
}

// bytesLine is data without a whole nonce line at a sentinel.
type bytesLine struct {
	tag, from string
	n         int
	at        time.Time
}

// fuzzer is one run's state.
type fuzzer struct {
	tb     *testbed.Testbed
	ctx    context.Context
	opts   Options
	world  *World
	expect check.Expectation
	pols   map[string]*policy.Policy
	res    identity.Resolver
	byTag  map[string]*Sentinel
	procs  []*sentinelProc
	logf   func(string, ...any)

	mu     sync.Mutex
	got    map[string][]receipt // nonce → where it arrived
	cond   chan struct{}
	bytes  []bytesLine
	runs   map[string]*execRun // nonce prefix → run
	owner  string
	idents map[string]check.Party // "user" or "user+group" → party
	report *Report
}

// execRun is one program run: whose nonces a prefix stands for.
type execRun struct {
	prog    *Program
	attack  bool
	round   int
	runNode string
	res     ExecResult
	peerRes ExecResult
	// start, end: when the run's processes ran (bytes without a nonce are
	// attributed to the run that was sending then).
	start, end time.Time
}

// Run fuzzes tb for opts.Duration.
func Run(ctx context.Context, tb *testbed.Testbed, opts Options) (*Report, error) {
	if opts.BasePort == 0 {
		opts.BasePort = 47000
	}
	if opts.Minimize == 0 {
		opts.Minimize = 3
	}
	if opts.Mode == "" {
		opts.Mode = tb.Mode
		if opts.Mode == "" {
			opts.Mode = "none"
		}
	}
	logf := opts.Log
	if logf == nil {
		logf = func(string, ...any) {}
	}
	expect, err := check.Expect(opts.Mode)
	if err != nil {
		return nil, err
	}
	if opts.Expect != nil {
		expect = opts.Expect
	}
	f := &fuzzer{tb: tb, ctx: ctx, opts: opts, expect: expect, logf: logf, got: map[string][]receipt{},
		cond: make(chan struct{}), runs: map[string]*execRun{}, idents: map[string]check.Party{},
		byTag: map[string]*Sentinel{}}
	f.report = &Report{Seed: opts.Seed, Mode: opts.Mode, Testbed: tb.Name, Wraps: map[string]int{}, Errnos: map[string]int{}}
	t0 := time.Now()
	if err := f.setup(); err != nil {
		f.stop()
		return nil, err
	}
	defer f.stop()
	if opts.Replay != nil {
		f.round(0, opts.Replay)
	} else {
		deadline := time.Now().Add(opts.Duration)
		for i := 0; time.Now().Before(deadline) && ctx.Err() == nil; i++ {
			if opts.StopAfter > 0 && len(f.report.Findings) >= opts.StopAfter {
				break
			}
			f.round(i, Generate(f.world, opts.Seed, i))
		}
	}
	f.sweep()
	f.report.Elapsed = time.Since(t0)
	return f.report, nil
}

// setup resolves identities and policies and starts the sentinels.
func (f *fuzzer) setup() error {
	sys := identity.System()
	f.res = sys
	pols, err := check.NodePolicies(f.tb, sys, f.opts.Mode != "none")
	if err != nil {
		return err
	}
	f.pols = pols
	var nodes []NodeAddrs
	for _, n := range f.tb.Nodes {
		if len(f.opts.Nodes) > 0 && !slices.Contains(f.opts.Nodes, n.Name) {
			continue
		}
		ll, _ := f.linkLocal(n.Name)
		nodes = append(nodes, NewNodeAddrs(n.Name, n.Eth0V4, n.Eth0V6, n.IBV4, n.IBV6, ll))
		f.report.Nodes = append(f.report.Nodes, n.Name)
	}
	if len(nodes) == 0 {
		return errors.New("no nodes to fuzz")
	}
	victim, err := check.ListenerParty(sys, "alice", "alice", "")
	if err != nil {
		return err
	}
	f.owner = "alice"
	f.world = &World{Nodes: nodes, Attackers: []string{"bob", "carol"}, Owner: f.owner, Slurm: slurmUp(f.tb),
		VictimUID: victim.UID, VictimGID: victim.GID}
	for _, u := range []string{"alice", "bob", "carol"} {
		p, err := check.ConnectorParty(sys, u)
		if err != nil {
			return err
		}
		f.idents[u] = p
		g := p
		if gid, err := sys.LookupGroup("proj1"); err == nil {
			g.GID = gid
		}
		f.idents[u+"+proj1"] = g
	}
	for _, o := range Owners {
		p, err := check.ListenerParty(sys, o.Name, "alice", o.Group)
		if err != nil {
			return err
		}
		f.idents["listener:"+o.Name] = p
	}
	all, left := ForMode(BuildSentinels(nodes, f.opts.BasePort), f.opts.Mode)
	for form, why := range left {
		f.logf("fuzz: no %q sentinels in mode %s: %s", form, f.opts.Mode, why)
	}
	if err := f.startSentinels(all); err != nil {
		return err
	}
	if s := check.SettlerFor(f.opts.Mode); s != nil {
		if err := s(f.ctx, f.tb, f.settleCases()); err != nil {
			f.warn("the data plane did not settle: %v", err)
		}
	}
	f.logf("fuzz: seed %d, mode %s, %d sentinels on %d nodes (protocols %s; missing %s), Slurm %v",
		f.opts.Seed, f.opts.Mode, len(f.world.Sentinels), len(nodes), strings.Join(f.report.Protos, ","),
		strings.Join(f.report.Missing, ","), f.world.Slurm)
	return nil
}

func (f *fuzzer) warn(format string, args ...any) {
	w := fmt.Sprintf(format, args...)
	f.report.Warnings = append(f.report.Warnings, w)
	f.logf("fuzz: warning: %s", w)
}

// settleCases are what the mode's settler waits for: every attacker's
// way to every sentinel owner, judged.
func (f *fuzzer) settleCases() []*check.Case {
	var cs []*check.Case
	for _, s := range f.world.Sentinels {
		if s.Form != "wild" || s.Proto != "tcp" || s.Fam != 4 {
			continue
		}
		for _, u := range f.world.Attackers {
			c := f.caseFor(u, s.Node, s, netip.Addr{})
			c.Expected = f.expect(c)
			cs = append(cs, c)
		}
	}
	return cs
}

func slurmUp(tb *testbed.Testbed) bool {
	_, err := os.Stat(tb.SlurmConf())
	return err == nil
}

// linkLocal is node's eth0 link-local address (zone eth0).
func (f *fuzzer) linkLocal(node string) (netip.Addr, error) {
	ctx, cancel := context.WithTimeout(f.ctx, 20*time.Second)
	defer cancel()
	out, err := f.tb.Output(ctx, node, "", "ip", "-6", "-o", "addr", "show", "dev", "eth0", "scope", "link")
	if err != nil {
		return netip.Addr{}, err
	}
	for _, w := range strings.Fields(out) {
		if p, err := netip.ParsePrefix(w); err == nil && p.Addr().IsLinkLocalUnicast() {
			return p.Addr().WithZone("eth0"), nil
		}
	}
	return netip.Addr{}, fmt.Errorf("%s: no link-local address", node)
}

// sentinelProc is one (node, owner)'s sentinel process.
type sentinelProc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
}

func (f *fuzzer) startSentinels(all []*Sentinel) error {
	type key struct{ node, owner string }
	groups := map[key][]*Sentinel{}
	var keys []key
	for _, s := range all {
		k := key{s.Node, s.Owner}
		if _, ok := groups[k]; !ok {
			keys = append(keys, k)
		}
		groups[k] = append(groups[k], s)
	}
	ready := make(chan attack.SinkLine, len(all))
	for _, k := range keys {
		ss := groups[k]
		var specs []attack.SinkSpec
		for _, s := range ss {
			specs = append(specs, s.Spec())
			f.byTag[s.Tag] = s
		}
		argv := []string{f.tb.LabBinary, "probe", "sentinel"}
		if ss[0].Group != "" {
			argv = []string{"sg", ss[0].Group, "-c", "exec " + strings.Join(argv, " ")}
		}
		cmd := f.tb.Command(f.ctx, k.node, "alice", argv...)
		stdin, err := cmd.StdinPipe()
		if err != nil {
			return err
		}
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
		f.procs = append(f.procs, &sentinelProc{cmd: cmd, stdin: stdin})
		b, _ := json.Marshal(specs)
		if _, err := stdin.Write(append(b, '\n')); err != nil {
			return fmt.Errorf("sentinels of %s on %s: %v (%s)", k.owner, k.node, err, stderr.String())
		}
		go f.read(out, ready)
	}
	up := map[string]bool{}
	missing := map[string]bool{}
	timeout := time.After(patience(30 * time.Second))
	for range all {
		select {
		case l := <-ready:
			s := f.byTag[l.Tag]
			switch {
			case l.Type == "ready":
				up[l.Tag] = true
			case s != nil && (l.Errno == "EPROTONOSUPPORT" || l.Errno == "ESOCKTNOSUPPORT" || l.Errno == "EAFNOSUPPORT"):
				missing[s.Proto] = true
			default:
				f.warn("sentinel %s: %s", l.Tag, l.Error)
			}
		case <-timeout:
			return fmt.Errorf("sentinels: only %d of %d ready after %v", len(up), len(all), patience(30*time.Second))
		case <-f.ctx.Done():
			return f.ctx.Err()
		}
	}
	protos := map[string]bool{}
	for _, s := range all {
		if up[s.Tag] {
			f.world.Sentinels = append(f.world.Sentinels, s)
			protos[s.Proto] = true
		}
	}
	for p := range protos {
		f.report.Protos = append(f.report.Protos, p)
		f.world.Protos = append(f.world.Protos, p)
		if p == "sctp" {
			f.world.Protos = append(f.world.Protos, "sctp-seq")
		}
	}
	sort.Strings(f.world.Protos)
	for p := range missing {
		if !protos[p] {
			f.report.Missing = append(f.report.Missing, p)
		}
	}
	sort.Strings(f.report.Protos)
	sort.Strings(f.report.Missing)
	if len(f.world.Sentinels) == 0 {
		return errors.New("no sentinel came up")
	}
	return nil
}

// read takes a sentinel process's lines: ready/error lines to ready, the
// receipts into f.got.
func (f *fuzzer) read(out io.Reader, ready chan<- attack.SinkLine) {
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		var l attack.SinkLine
		if json.Unmarshal(sc.Bytes(), &l) != nil {
			continue
		}
		switch l.Type {
		case "ready", "error":
			ready <- l
		case "got":
			f.mu.Lock()
			f.got[l.Nonce] = append(f.got[l.Nonce], receipt{l.Tag, l.From})
			close(f.cond)
			f.cond = make(chan struct{})
			f.mu.Unlock()
		case "bytes":
			f.mu.Lock()
			f.bytes = append(f.bytes, bytesLine{l.Tag, l.From, l.Bytes, time.Now()})
			f.mu.Unlock()
		}
	}
}

func (f *fuzzer) stop() {
	for _, p := range f.procs {
		p.stdin.Close()
	}
	for _, p := range f.procs {
		done := make(chan struct{})
		go func() { p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(3 * time.Second):
			syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
	}
	f.procs = nil
}

func newPrefix() string {
	var b [6]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// runNode is where the program's process runs.
func (p *Program) runNode() string {
	if p.Via != "" {
		return p.Via
	}
	return p.Node
}

// asOwner is the program as the sentinels' owner runs it (the positive
// control): the same calls, the same way of starting.
func (p *Program) asOwner(owner string) *Program {
	q := *p
	q.User = owner
	if q.Peer != "" {
		q.Peer = owner
	}
	return &q
}

// exec runs prog (and its peer) and records the nonces it sent.
func (f *fuzzer) exec(prog *Program, attackRun bool, round int) *execRun {
	prefix := newPrefix()
	er := &execRun{prog: prog, attack: attackRun, round: round, runNode: prog.runNode(), start: time.Now()}
	defer func() { er.end = time.Now() }()
	f.mu.Lock()
	f.runs[prefix] = er
	f.mu.Unlock()
	b, _ := json.Marshal(prog)
	enc := base64.RawURLEncoding.EncodeToString(b)
	var peer *exec.Cmd
	var peerOut *bufio.Reader
	if prog.Peer != "" {
		ctx, cancel := context.WithTimeout(f.ctx, patience(30*time.Second))
		defer cancel()
		peer = f.tb.Command(ctx, prog.Node, prog.Peer, f.tb.LabBinary, "probe", "fuzz", "--prefix", prefix, "--peer",
			"--wait", patience(ConnectWait).String(), "--prog", enc)
		peer.WaitDelay = 2 * time.Second
		out, err := peer.StdoutPipe()
		if err == nil {
			err = peer.Start()
		}
		if err != nil {
			er.peerRes.Error = err.Error()
			peer = nil
		} else {
			peerOut = bufio.NewReader(out)
			var l ExecResult
			line, _ := peerOut.ReadBytes('\n')
			if json.Unmarshal(line, &l) != nil || l.Type != "ready" {
				er.peerRes.Error = "peer did not start: " + strings.TrimSpace(string(line))
			}
		}
	}
	argv := []string{f.tb.LabBinary, "probe", "fuzz", "--prefix", prefix, "--wait", patience(ConnectWait).String(), "--prog", enc}
	user := prog.User
	switch prog.Wrap {
	case "unshare-r":
		argv = append([]string{"unshare", "-r", "--"}, argv...)
	case "unshare-rn":
		argv = append([]string{"unshare", "-rn", "--"}, argv...)
	case "sg":
		argv = []string{"sg", "proj1", "-c", "exec " + strings.Join(argv, " ")}
	case "su":
		argv = []string{"su", f.owner, "-c", strings.Join(argv, " ")}
	case "ssh":
		argv = append(append([]string{"ssh"}, sshOpts()...), prog.Via, strings.Join(argv, " "))
	case "srun":
		argv = append([]string{"srun", "--job-name=palfuzz", "--quiet", "-N1", "-n1", "-w", prog.Via}, argv...)
	}
	ctx, cancel := context.WithTimeout(f.ctx, patience(60*time.Second))
	defer cancel()
	cmd := f.tb.Command(ctx, prog.Node, user, argv...)
	cmd.Stdin = nil
	cmd.WaitDelay = 3 * time.Second
	if prog.Wrap == "srun" {
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	}
	out, err := cmd.Output()
	er.res = lastResult(out)
	if er.res.Type != "done" {
		msg := strings.TrimSpace(string(out))
		if err != nil {
			msg = err.Error() + " " + msg
		}
		er.res.Error = "no result: " + summarize(msg)
	}
	if peer != nil {
		rest, _ := io.ReadAll(peerOut)
		peer.Wait()
		er.peerRes = lastResult(rest)
	}
	return er
}

func lastResult(out []byte) ExecResult {
	var r ExecResult
	for _, l := range strings.Split(string(out), "\n") {
		var x ExecResult
		if json.Unmarshal([]byte(l), &x) == nil && x.Type == "done" {
			r = x
		}
	}
	return r
}

func summarize(s string) string {
	if len(s) > 300 {
		return s[:300] + "…"
	}
	return s
}

// inVM: the fuzzer runs inside the uvn VM (relayed check), under
// emulation: patient, not lenient (as check's matrix there).
func inVM() bool { return os.Getenv("PALISADE_VM") == "1" }

// patience stretches a wait under emulation.
func patience(d time.Duration) time.Duration {
	if inVM() {
		return 10 * d
	}
	return d
}

func sshOpts() []string {
	if inVM() {
		return []string{"-o", "ConnectTimeout=90"}
	}
	return nil
}

// sends lists the nonces of the run's accepted sends.
func (er *execRun) sends() (all, ok []string) {
	for _, rs := range [][]StepResult{er.res.Steps, er.peerRes.Steps} {
		for _, s := range rs {
			if s.Nonce == "" {
				continue
			}
			all = append(all, s.Nonce)
			if s.OK {
				ok = append(ok, s.Nonce)
			}
		}
	}
	return
}

// waitAny waits until every nonce in want arrived or d passed, returning
// how many arrived.
func (f *fuzzer) waitAll(want []string, d time.Duration) int {
	deadline := time.After(d)
	for {
		f.mu.Lock()
		n := 0
		for _, w := range want {
			if len(f.got[w]) > 0 {
				n++
			}
		}
		c := f.cond
		f.mu.Unlock()
		if n == len(want) {
			return n
		}
		select {
		case <-c:
		case <-deadline:
			return n
		case <-f.ctx.Done():
			return n
		}
	}
}

// round runs one program as the attacker, then as the owner, then the
// owner's probe, and judges what arrived.
func (f *fuzzer) round(i int, prog *Program) {
	rep := f.report
	rep.Rounds++
	rep.Wraps[prog.Wrap]++
	at := f.exec(prog, true, i)
	for _, sr := range at.res.Steps {
		if !sr.OK && sr.I < len(prog.Steps) {
			st := prog.Steps[sr.I]
			k := st.Op
			if st.Op == "setsockopt" {
				k += " " + st.Opt
			}
			rep.Errnos[k+" "+sr.Errno]++
		}
	}
	all, ok := at.sends()
	rep.Sends += len(all)
	rep.SendsOK += len(ok)
	if at.res.Error != "" && prog.Wrap != "su" {
		f.logf("fuzz: round %d: attacker program (%s, wrap %q): %s", i, prog.User, prog.Wrap, at.res.Error)
	}
	// The positive control: the same program as the owner.
	ctl := f.exec(prog.asOwner(f.owner), false, i)
	call, cok := ctl.sends()
	rep.ControlSends += len(call)
	rep.ControlOKSends += len(cok)
	// The owner's probe (sent last) is waited for; its arrival and
	// Grace acknowledge the paths of everything sent before it.
	f.probe(i, prog)
	time.Sleep(patience(attack.Grace))
	n := f.waitAll(cok, 0)
	rep.ControlDelivered += n
	if len(cok) > 0 && prog.Wrap != "unshare-rn" && prog.Wrap != "su" {
		rep.ControlRoundsOK++
		if n > 0 {
			rep.ControlRoundsReached++
		}
	}
	leaks := f.leaks(at)
	if len(leaks) > 0 {
		fd := &Finding{Round: i, Program: prog, Leaks: leaks}
		fd.Known = knownFinding(f.world, fd)
		rep.Findings = append(rep.Findings, fd)
		f.logf("fuzz: round %d: LEAK %s", i, describeLeaks(leaks))
		if f.shouldMinimize(fd) {
			f.minimize(fd)
		}
	}
	if i%10 == 9 {
		f.logf("fuzz: %d rounds, %d sends (%d accepted), %d findings, control reached %d/%d rounds",
			rep.Rounds, rep.Sends, rep.SendsOK, len(rep.Findings), rep.ControlRoundsReached, rep.ControlRoundsOK)
	}
}

// shouldMinimize: up to Minimize new findings, and the first of each known
// kind (its reproduction is in docs/fuzz.md already; once is a check).
func (f *fuzzer) shouldMinimize(fd *Finding) bool {
	if f.opts.Minimize < 0 {
		return false
	}
	n := 0
	for _, o := range f.report.Findings {
		if o.Minimal == nil {
			continue
		}
		if fd.Known != "" && o.Known == fd.Known {
			return false
		}
		if o.Known == "" {
			n++
		}
	}
	return fd.Known != "" || n < f.opts.Minimize
}

// probe: the owner sends one plain datagram or stream to the round's
// first target from where the program ran; it must arrive.
func (f *fuzzer) probe(i int, prog *Program) {
	if prog.Wrap == "unshare-rn" {
		return
	}
	var t *Sentinel
	for _, s := range prog.Steps {
		if s.Addr == "" || !s.sends() && s.Op != "connect" {
			continue
		}
		ap, err := netip.ParseAddrPort(s.Addr)
		if err != nil {
			continue
		}
		for _, x := range f.world.Sentinels {
			if x.Port == int(ap.Port()) && f.world.addrOf(x.Node, ap.Addr()) {
				t = x
				break
			}
		}
		if t != nil {
			break
		}
	}
	if t == nil {
		return
	}
	node := prog.runNode()
	dst := f.world.unicast(t, node)
	if !dst.IsValid() {
		node = t.Node
		dst = f.world.unicast(t, node)
	}
	p := &Program{Node: node, User: f.owner, Steps: []Step{{Op: "socket", Fam: t.Fam, Proto: t.Proto}}}
	if t.stream() {
		p.Steps = append(p.Steps, Step{Op: "connect", Addr: netip.AddrPortFrom(dst, uint16(t.Port)).String()}, Step{Op: "send"})
	} else {
		p.Steps = append(p.Steps, Step{Op: "sendto", Addr: netip.AddrPortFrom(dst, uint16(t.Port)).String()})
	}
	f.report.Probes++
	er := f.exec(p, false, i)
	_, ok := er.sends()
	if len(ok) == 0 || f.waitAll(ok, patience(3*time.Second)) == 0 {
		why := er.res.Error
		for _, s := range er.res.Steps {
			if !s.OK {
				why = fmt.Sprintf("step %d %s: %s", s.I, p.Steps[s.I], s.Errno)
			}
		}
		miss := fmt.Sprintf("round %d: alice@%s → %s (%s): not delivered %s", i, node, t.Tag, netip.AddrPortFrom(dst, uint16(t.Port)), why)
		f.report.ProbeMisses = append(f.report.ProbeMisses, miss)
		f.logf("fuzz: probe miss: %s", miss)
	}
}

// addrOf reports whether a names node (one of its addresses, or a form
// that reaches it: loopback, unspecified, broadcast, multicast).
func (w *World) addrOf(node string, a netip.Addr) bool {
	for _, n := range w.Nodes {
		if n.Name != node {
			continue
		}
		a = a.Unmap().WithZone("")
		return a == n.Eth0V4 || a == n.Eth0V6 || a == n.IBV4 || a == n.IBV6 || a == n.LinkLocal.WithZone("")
	}
	return false
}

// unicast is the address from node that reaches t (invalid if none: a
// loopback sentinel on another node).
func (w *World) unicast(t *Sentinel, from string) netip.Addr {
	switch t.Form {
	case "lo":
		if from != t.Node {
			return netip.Addr{}
		}
		return t.Addr
	case "wild", "mcast":
		for _, n := range w.Nodes {
			if n.Name == t.Node {
				return pick(t.Fam, n.Eth0V4, n.Eth0V6)
			}
		}
	}
	return t.Addr
}

// caseFor is a receipt as the matrix's judge sees it: connector user
// (with the group of the socket's creator) on node, the sentinel as
// listener, src the source the sentinel saw.
func (f *fuzzer) caseFor(user, node string, s *Sentinel, src netip.Addr) *check.Case {
	conn := f.idents[user]
	conn.Node = node
	lis := f.idents["listener:"+s.Owner]
	lis.Node = s.Node
	proto := policy.UDP
	if s.stream() {
		proto = policy.TCP
	}
	c := &check.Case{Launcher: check.Plain, Path: check.Eth0, Proto: proto, Family: s.Fam, Connector: conn,
		Listener: lis, Dst: netip.AddrPortFrom(s.Addr.WithZone(""), uint16(s.Port)), Src: src.Unmap().WithZone(""),
		Policy: f.pols[s.Node]}
	if node == s.Node {
		c.Path = check.Self
		if s.Form == "lo" {
			c.Path = check.Loopback
		}
		// Within a node the matrix takes the dialled local address as the
		// source the kernel picked (check.Case.Conn); here the source is
		// known: what the sentinel saw (or, unknown, the node's address).
		a := src.Unmap().WithZone("")
		if !a.IsValid() {
			a = f.world.unicast(s, node)
		}
		c.Dst = netip.AddrPortFrom(a, uint16(s.Port))
	}
	return c
}

// leaks judges every nonce of er that arrived: an attacker's at a
// sentinel the mode refuses him is a leak.
func (f *fuzzer) leaks(er *execRun) []Leak {
	var out []Leak
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, rs := range [][]StepResult{er.res.Steps, er.peerRes.Steps} {
		for _, st := range rs {
			if st.Nonce == "" {
				continue
			}
			for _, r := range f.got[st.Nonce] {
				l, bad := f.judge(er, st, r)
				if !bad {
					continue
				}
				if k := slices.IndexFunc(out, func(o Leak) bool {
					return o.Sentinel == l.Sentinel && o.Step == l.Step && o.Peer == l.Peer && o.From == l.From
				}); k >= 0 {
					out[k].Count++
					continue
				}
				l.Count = 1
				out = append(out, l)
			}
		}
	}
	return out
}

// judge decides one receipt. The socket's creator is the identity: the
// main program's user (under sg proj1: with its gid), also for the steps a
// peer makes on sockets it was handed.
func (f *fuzzer) judge(er *execRun, st StepResult, r receipt) (Leak, bool) {
	s := f.byTag[r.tag]
	if s == nil || !er.attack {
		return Leak{}, false
	}
	who := er.prog.User
	if er.prog.Wrap == "sg" {
		who += "+proj1"
	}
	from, _ := netip.ParseAddrPort(r.from)
	c := f.caseFor(who, er.runNode, s, from.Addr())
	v := f.expect(c)
	if v.Allow {
		return Leak{}, false
	}
	l := Leak{Sentinel: r.tag, Step: st.I, Peer: st.Peer, From: r.from, Rule: v.Rule}
	if n, ok := f.tb.Node(er.runNode); ok {
		a := n.Eth0V6
		if from.Addr().Unmap().Is4() {
			a = n.Eth0V4
		}
		c = f.caseFor(who, er.runNode, s, a)
		l.InClusterAllowed = f.expect(c).Allow
	}
	return l, true
}

func describeLeaks(ls []Leak) string {
	var w []string
	for _, l := range ls {
		p := ""
		if l.Peer {
			p = "peer "
		}
		n := ""
		if l.Count > 1 {
			n = fmt.Sprintf(" ×%d", l.Count)
		}
		w = append(w, fmt.Sprintf("%sstep %d → %s from %s%s (expected refused: %s)", p, l.Step, l.Sentinel, l.From, n, l.Rule))
	}
	return strings.Join(w, "; ")
}

// sweep catches attackers' nonces that arrived after their round was
// judged (nothing may arrive late either).
func (f *fuzzer) sweep() {
	time.Sleep(attack.Grace)
	seen := map[int]bool{}
	for _, fd := range f.report.Findings {
		seen[fd.Round] = true
	}
	f.mu.Lock()
	var late []*execRun
	for _, er := range f.runs {
		if er.attack && !seen[er.round] {
			late = append(late, er)
		}
	}
	f.mu.Unlock()
	for _, er := range late {
		if ls := f.leaks(er); len(ls) > 0 {
			fd := &Finding{Round: er.round, Program: er.prog, Leaks: ls}
			fd.Known = knownFinding(f.world, fd)
			f.report.Findings = append(f.report.Findings, fd)
			seen[er.round] = true
		}
	}
	sort.Slice(f.report.Findings, func(i, j int) bool { return f.report.Findings[i].Round < f.report.Findings[j].Round })
	f.attributeBytes()
}

// attributeBytes judges data without a whole nonce line (a stream cut
// short, the tail segment of a GSO send) by the run whose socket sent it:
// the same port on the sender's node, and the same address unless the
// socket was bound to the wildcard (getsockname then names no address).
func (f *fuzzer) attributeBytes() {
	type sender struct {
		er    *execRun
		local netip.AddrPort
	}
	f.mu.Lock()
	byPort := map[uint16][]sender{}
	for _, er := range f.runs {
		for _, rs := range [][]StepResult{er.res.Steps, er.peerRes.Steps} {
			for _, st := range rs {
				if a, err := netip.ParseAddrPort(st.Local); err == nil {
					byPort[a.Port()] = append(byPort[a.Port()], sender{er, a})
				}
			}
		}
	}
	lines := f.bytes
	f.mu.Unlock()
	for _, b := range lines {
		from, _ := netip.ParseAddrPort(b.from)
		// The attacker's and the owner's runs of one program bind the same
		// fixed ports: the run that was sending when the bytes came decides.
		var er *execRun
		for _, c := range byPort[from.Port()] {
			la, fa := c.local.Addr().Unmap().WithZone(""), from.Addr().Unmap().WithZone("")
			if !(la == fa || (la.IsUnspecified() && (fa.IsLoopback() || f.world.addrOf(c.er.runNode, fa)))) {
				continue
			}
			if b.at.Before(c.er.start) || (!c.er.end.IsZero() && b.at.After(c.er.end.Add(patience(attack.Grace)))) {
				continue
			}
			if er == nil || c.er.start.After(er.start) {
				er = c.er
			}
		}
		if er == nil {
			f.report.Unattributed = append(f.report.Unattributed, fmt.Sprintf("%s: %d bytes from %s without a nonce", b.tag, b.n, b.from))
			continue
		}
		if l, bad := f.judge(er, StepResult{I: -1}, receipt{b.tag, b.from}); bad {
			fd := &Finding{Round: er.round, Program: er.prog,
				Leaks: []Leak{{Sentinel: l.Sentinel, Step: -1, From: l.From, Rule: l.Rule + fmt.Sprintf(", %d bytes without a nonce", b.n),
					InClusterAllowed: l.InClusterAllowed, Count: 1}}}
			fd.Known = knownFinding(f.world, fd)
			f.report.Findings = append(f.report.Findings, fd)
		}
	}
}

// leaksAlone runs prog as the attacker once and reports whether it leaks.
func (f *fuzzer) leaksAlone(prog *Program, round int) bool {
	er := f.exec(prog, true, round)
	_, ok := er.sends()
	if len(ok) == 0 {
		return false
	}
	time.Sleep(patience(2 * attack.Grace))
	return len(f.leaks(er)) > 0
}

// minimize delta-debugs fd's program (ddmin over the main steps, then the
// peer's) down to a program that still leaks when run alone.
func (f *fuzzer) minimize(fd *Finding) {
	const budget = 60
	tests := 0
	test := func(p *Program) bool {
		if tests >= budget || f.ctx.Err() != nil {
			return false
		}
		tests++
		return f.leaksAlone(p, fd.Round)
	}
	p := *fd.Program
	if !test(&p) {
		fd.Minimal = fd.Program
		f.logf("fuzz: round %d: the program does not leak again when run alone (state of earlier rounds, or a race)", fd.Round)
		return
	}
	fd.Reproduced = true
	p.Steps = ddmin(p.Steps, func(steps []Step) bool { q := p; q.Steps = steps; return test(&q) })
	if p.Peer != "" {
		p.PeerSteps = ddmin(p.PeerSteps, func(steps []Step) bool { q := p; q.PeerSteps = steps; return test(&q) })
	}
	// Plain is simpler than any wrap: try without it.
	if p.Wrap != "" {
		q := p
		q.Wrap, q.Via = "", ""
		if test(&q) {
			p = q
		}
	}
	fd.Minimal = &p
	f.logf("fuzz: round %d: minimal reproduction (%d program runs):\n%s", fd.Round, tests, p.String())
}

// ddmin is Zeller's delta debugging: the smallest subsequence of steps
// (1-minimal) for which fails still holds.
func ddmin(steps []Step, fails func([]Step) bool) []Step {
	n := 2
	for len(steps) >= 2 {
		chunk := (len(steps) + n - 1) / n
		reduced := false
		for i := 0; i < len(steps); i += chunk {
			end := min(i+chunk, len(steps))
			complement := append(slices.Clone(steps[:i]), steps[end:]...)
			if fails(complement) {
				steps = complement
				n = max(n-1, 2)
				reduced = true
				break
			}
		}
		if !reduced {
			if n >= len(steps) {
				break
			}
			n = min(n*2, len(steps))
		}
	}
	return steps
}

// WriteReport prints the run: what ran, the positive control, every
// finding with its seed, round and minimal program; the last line says
// PASS or FAIL.
func (r *Report) Write(w io.Writer) {
	fmt.Fprintf(w, "palisade-lab check --fuzz: seed %d, mode %s, testbed %s (nodes %s), %v\n", r.Seed, r.Mode, r.Testbed,
		strings.Join(r.Nodes, ","), r.Elapsed.Round(time.Second))
	fmt.Fprintf(w, "sentinel protocols: %s", strings.Join(r.Protos, ", "))
	if len(r.Missing) > 0 {
		fmt.Fprintf(w, " (kernel lacks %s)", strings.Join(r.Missing, ", "))
	}
	fmt.Fprintln(w)
	var wraps []string
	for k, v := range r.Wraps {
		if k == "" {
			k = "plain"
		}
		wraps = append(wraps, fmt.Sprintf("%s %d", k, v))
	}
	sort.Strings(wraps)
	fmt.Fprintf(w, "attacker programs: %d (%s); sends %d, accepted by the kernel %d\n", r.Rounds, strings.Join(wraps, ", "), r.Sends, r.SendsOK)
	var errs []string
	for k, v := range r.Errnos {
		errs = append(errs, fmt.Sprintf("%s ×%d", k, v))
	}
	sort.Strings(errs)
	if len(errs) > 0 {
		fmt.Fprintf(w, "attackers' failed calls: %s\n", strings.Join(errs, "; "))
	}
	fmt.Fprintf(w, "positive control (same programs as alice): sends %d, accepted %d, delivered %d; reached a sentinel in %d of %d rounds; owner probes %d, missed %d\n",
		r.ControlSends, r.ControlOKSends, r.ControlDelivered, r.ControlRoundsReached, r.ControlRoundsOK, r.Probes, len(r.ProbeMisses))
	for _, m := range r.ProbeMisses {
		fmt.Fprintf(w, "  probe miss: %s\n", m)
	}
	for _, u := range r.Unattributed {
		fmt.Fprintf(w, "  UNATTRIBUTED: %s\n", u)
	}
	for _, wr := range r.Warnings {
		fmt.Fprintf(w, "  warning: %s\n", wr)
	}
	for _, fd := range r.Findings {
		kind := "FINDING"
		if fd.Known != "" {
			kind = "known finding (" + fd.Known + ")"
		}
		fmt.Fprintf(w, "\n%s: seed %d round %d: %s\n", kind, r.Seed, fd.Round, describeLeaks(fd.Leaks))
		fmt.Fprintf(w, "program:\n%s", fd.Program)
		if fd.Minimal != nil && fd.Minimal != fd.Program {
			fmt.Fprintf(w, "minimal reproduction (leaks alone: %v):\n%s", fd.Reproduced, fd.Minimal)
			b, _ := json.Marshal(fd.Minimal)
			fmt.Fprintf(w, "replay: palisade-lab check --fuzz-replay '%s'\n", b)
		} else {
			b, _ := json.Marshal(fd.Program)
			fmt.Fprintf(w, "replay: palisade-lab check --fuzz-replay '%s'\n", b)
		}
	}
	var unknown, known int
	for _, fd := range r.Findings {
		if fd.Known == "" {
			unknown++
		} else {
			known++
		}
	}
	status := "PASS"
	if r.Failed() {
		status = "FAIL"
	}
	why := ""
	if c := r.controlBroken(); c != "" {
		why = "; positive control failed: " + c
	}
	fmt.Fprintf(w, "\n%s: %d findings (%d known), %d unattributed%s; reproduce with --seed %d\n", status, unknown, known,
		len(r.Unattributed), why, r.Seed)
}
