package check

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/identity"
	"github.com/palisade-hpc/palisade/internal/policy"
	"github.com/palisade-hpc/palisade/internal/sys/pidfd"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
	"github.com/palisade-hpc/palisade/lab/probe"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Options select what Run covers.
type Options struct {
	// Mode names the expectation (RegisterMode); default "none".
	Mode string
	// Launchers to run; default all.
	Launchers []Launcher
	// Quick runs fewer identities (still every launcher, path, protocol
	// and family).
	Quick bool
	// Connectors and Listeners narrow the identities to these names
	// (Connectors; ListenerSpec.Name); nil = all, or quick's.
	Connectors, Listeners []string
	// Timeout bounds the whole run (default 5 minutes; 30 inside the uvn VM).
	Timeout time.Duration
	// Log receives progress lines; nil = quiet.
	Log io.Writer
	// Resolver answers identity questions (default identity.System()).
	Resolver identity.Resolver
	// Unix adds abstract Unix socket cases (Path Unix): "on", "off", or
	// "auto" / "" = on in mode userwall where node1's agent reports them
	// enforced (`palisade status`: unix_enforced), off otherwise.
	Unix string
}

// Run runs the matrix on tb and reports every case. The error is for a run
// that could not be attempted at all (unknown mode, unreadable policy, no
// testbed directory); anything that goes wrong once traffic flows — a
// launcher that cannot start, a listener that does not come up, a process
// that answers as the wrong user — is a failed case in the report.
func Run(ctx context.Context, tb *testbed.Testbed, opts Options) (*Report, error) {
	t0 := time.Now()
	if opts.Mode == "" {
		opts.Mode = "none"
	}
	expect, err := lookupMode(opts.Mode)
	if err != nil {
		return nil, err
	}
	if len(opts.Launchers) == 0 {
		opts.Launchers = Launchers
	}
	for _, l := range opts.Launchers {
		if !slices.Contains(Launchers, l) {
			return nil, fmt.Errorf("unknown launcher %q (known: %v)", l, Launchers)
		}
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 5 * time.Minute
		if inVM() {
			opts.Timeout = 30 * time.Minute
		}
	}
	sys := identity.System()
	if inVM() {
		// Under emulation on a loaded host a getent call can take longer
		// than the default bound (seen: killed after 10 s in the 6.1 VM).
		sys.Timeout = 2 * time.Minute
	}
	if opts.Resolver == nil {
		opts.Resolver = sys
	}
	conns, lis, err := SelectIdentities(opts.Quick, opts.Connectors, opts.Listeners)
	if err != nil {
		return nil, err
	}
	unix, why := wantUnix(ctx, tb, opts)
	m, err := buildMatrixFor(tb, opts.Resolver, opts.Launchers, conns, lis)
	if err != nil {
		return nil, err
	}
	if unix {
		m.addUnix()
	}
	// Every node's policy, as the data plane there reads it. Mode none
	// needs none; any other mode may, so a broken config is an error.
	pols, err := NodePolicies(tb, sys, opts.Mode != "none")
	if err != nil {
		return nil, err
	}
	for _, c := range m.cases {
		c.Policy = pols[c.Listener.Node]
		c.Expected = expect(c)
		// Staged rollout (testbed up --agents): nothing decides on a node
		// without the agent.
		if opts.Mode != "none" && c.Managed() && !tb.Enforcing(c.Listener.Node) {
			c.Expected = Verdict{Allow: true, Rule: RuleUnenforcedNode}
		}
	}

	ctx, cancel := context.WithTimeout(ctx, opts.Timeout)
	defer cancel()
	r := &runner{tb: tb, m: m, log: opts.Log}
	err = r.prepare()
	if r.dir != "" {
		defer os.RemoveAll(r.dir)
	}
	if err != nil {
		return nil, err
	}

	r.logf("abstract Unix cases: %v (%s)", unix, why)
	if !unix && opts.Mode == "userwall" {
		r.warnings = append(r.warnings, "abstract Unix socket cases not run: "+why)
	}
	r.logf("matrix: %d cases, %d connector processes, %d listeners on %d hosts", len(m.cases), len(m.procs),
		len(m.listeners)*len(m.listenerHosts()), len(m.listenerHosts()))
	r.startListeners(ctx)
	defer r.stopListeners()
	if settle := lookupSettler(opts.Mode); settle != nil {
		t := time.Now()
		if err := settle(ctx, tb, m.cases); err != nil {
			r.warn("the data plane did not settle: %v", err)
		}
		r.logf("settled in %v", time.Since(t).Round(time.Millisecond))
	}

	// Without Slurm first (quick, and the same nodes as Slurm's would
	// otherwise compete for two cores), then every Slurm and MPI launcher
	// at once: all sbatch jobs are submitted before anything waits.
	var direct, slurm []*proc
	for _, p := range m.procs {
		if p.Launcher == Plain || p.Launcher == SSH {
			direct = append(direct, p)
		} else {
			slurm = append(slurm, p)
		}
	}
	r.runAll(ctx, direct)
	if inVM() {
		// Under emulation, concurrent Slurm launchers queue behind each
		// other, and a queued srun is never told that its allocation was
		// granted (slurmctld's callback cannot reach srun in the user's
		// VRF, docs/uvn.md): one launcher at a time.
		for _, p := range slurm {
			r.runAll(ctx, []*proc{p})
		}
	} else {
		r.runAll(ctx, slurm)
	}
	if ctx.Err() != nil {
		r.cancelJobs()
	}

	for _, p := range m.procs {
		r.collect(p)
	}
	checkAuditEvents(tb, t0, m.cases)
	rep := &Report{Mode: opts.Mode, Testbed: tb.Name, Nodes: len(tb.Nodes), Cases: m.cases,
		Warnings: r.warnings, Elapsed: time.Since(t0)}
	if ctx.Err() != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("run stopped after %v", opts.Timeout))
	}
	return rep, nil
}

type runner struct {
	tb  *testbed.Testbed
	m   *matrix
	log io.Writer
	dir string // plans; out/ for results (world-writable, sticky)

	mu        sync.Mutex
	listeners []*listenerProc
	dead      map[string]string // "host/listener" → why it did not start
	warnings  []string
}

func (r *runner) logf(format string, args ...any) {
	if r.log != nil {
		fmt.Fprintf(r.log, "check: "+format+"\n", args...)
	}
}

func (r *runner) warn(format string, args ...any) {
	r.mu.Lock()
	r.warnings = append(r.warnings, fmt.Sprintf(format, args...))
	r.mu.Unlock()
}

func (r *runner) outDir() string { return filepath.Join(r.dir, "out") }

// prepare writes one plan per connector process into a directory that every
// user on every node can read (the testbed directory is shared by all
// nodes, like an NFS home), with a sticky world-writable out/ for results.
func (r *runner) prepare() error {
	dir, err := os.MkdirTemp(r.tb.Dir, "check-")
	if err != nil {
		return fmt.Errorf("check run directory: %w", err)
	}
	r.dir = dir
	if err := os.Chmod(dir, 0o755); err != nil {
		return err
	}
	if err := os.Mkdir(r.outDir(), 0o755); err != nil {
		return err
	}
	if err := os.Chmod(r.outDir(), 0o1777); err != nil {
		return err
	}
	for _, p := range r.m.procs {
		plan := probe.Plan{Hosts: map[string][]probe.Target{}}
		if inVM() {
			// Every process under emulation may wait seconds for a CPU:
			// a listener's SYN-ACK or reply can be late without anything
			// dropping it (a 6.1 guest at host load 28 timed out 5 s
			// loopback handshakes to root's system port). Refusals
			// still return at once (resets), so the bound costs only
			// when something is really lost.
			plan.TCPTimeoutMS, plan.ReplyTimeoutMS, plan.UDPWaitMS = 20000, 20000, 600
		}
		for _, c := range p.Cases {
			h := c.Connector.Node
			t := probe.Target{ID: c.ID, Addr: c.Dst.String(), Proto: c.Proto.String()}
			if c.Path == Unix {
				t.Addr, t.Proto = c.Abstract, probe.ProtoUnixStream
				if c.Proto == policy.UDP {
					t.Proto = probe.ProtoUnixDgram
				}
			}
			plan.Hosts[h] = append(plan.Hosts[h], t)
		}
		b, _ := json.Marshal(plan)
		if err := os.WriteFile(r.planPath(p), b, 0o644); err != nil {
			return err
		}
	}
	return nil
}

func (r *runner) planPath(p *proc) string { return filepath.Join(r.dir, p.tag+".plan.json") }

// listenerProc is one running `palisade-lab probe listen`.
type listenerProc struct {
	host  string
	spec  ListenerSpec
	cmd   *exec.Cmd
	stdin io.WriteCloser
	pid   int // the listener's own pid, from its ready line
}

// inVM reports a run inside the uvn VM (the guest agent sets PALISADE_VM=1):
// software emulation makes every process start cost 0.2-0.6 s, so
// listeners get more time and start a few at a time, connectors wait
// longer for answers, launchers wait longer for ssh and Slurm, and the
// Slurm launchers run one after the other.
func inVM() bool { return os.Getenv("PALISADE_VM") == "1" }

func readyTimeout() time.Duration {
	if inVM() {
		return 3 * time.Minute
	}
	return 15 * time.Second
}

func listenerStarts() int {
	if inVM() {
		return 4
	}
	return 1 << 20
}

// startListeners starts every listener on every targeted host at once and
// waits for each to report ready (all its sockets bound) with the identity
// the matrix expects.
func (r *runner) startListeners(ctx context.Context) {
	t0 := time.Now()
	r.dead = map[string]string{}
	var wg sync.WaitGroup
	sem := make(chan struct{}, listenerStarts())
	for _, h := range r.m.listenerHosts() {
		for _, l := range r.m.listeners {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sem <- struct{}{}
				lp, err := r.startListener(ctx, h, l)
				<-sem
				r.mu.Lock()
				defer r.mu.Unlock()
				if lp != nil {
					r.listeners = append(r.listeners, lp)
				}
				if err != nil {
					r.dead[h+"/"+l.Name] = err.Error()
				}
			}()
		}
	}
	wg.Wait()
	r.logf("listeners: %d up, %d failed in %v", len(r.listeners)-len(r.dead), len(r.dead), time.Since(t0).Round(time.Millisecond))
	for k, why := range r.dead {
		r.logf("listener %s: %s", k, why)
	}
}

func (r *runner) startListener(ctx context.Context, host string, l ListenerSpec) (*listenerProc, error) {
	argv := []string{r.tb.LabBinary, "probe", "listen", "--ports", strconv.Itoa(int(l.Port)),
		"--exit-on-stdin-eof", "--lifetime", "1h"}
	if r.m.unix {
		argv = append(argv, "--proto", "tcp,udp,unix")
	}
	if l.Group != "" {
		argv = []string{"sg", l.Group, "-c", "exec " + shellJoin(argv)}
	}
	cmd := r.tb.Command(ctx, host, asUser(l.User), argv...)
	cmd.WaitDelay = 2 * time.Second
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	lp := &listenerProc{host: host, spec: l, cmd: cmd, stdin: stdin}
	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(stdout).ReadString('\n')
		line <- s
		io.Copy(io.Discard, stdout)
	}()
	var ready struct {
		Type     string `json:"type"`
		PID      int    `json:"pid"`
		UID, GID uint32
		Host     string `json:"host"`
	}
	select {
	case s := <-line:
		if err := json.Unmarshal([]byte(s), &ready); err != nil || ready.Type != "ready" {
			cmd.Wait()
			return lp, fmt.Errorf("%v %s", cmd.ProcessState, summarize(stderr.String(), 3))
		}
	case <-time.After(readyTimeout()):
		return lp, fmt.Errorf("not ready after %v", readyTimeout())
	case <-ctx.Done():
		return lp, ctx.Err()
	}
	lp.pid = ready.PID
	want := r.m.parties[l.Name]
	if ready.UID != want.UID || ready.GID != want.GID || ready.Host != host {
		return lp, fmt.Errorf("runs as uid=%d gid=%d on %s, want uid=%d gid=%d on %s",
			ready.UID, ready.GID, ready.Host, want.UID, want.GID, host)
	}
	return lp, nil
}

// stopListeners ends every listener this run started: by its own pid (sg
// may stand between the started process and the listener), after checking
// that the pid is still that listener, then by closing its stdin.
func (r *runner) stopListeners() {
	var wg sync.WaitGroup
	for _, lp := range r.listeners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lp.stdin.Close()
			for _, pid := range []int{lp.pid, lp.cmd.Process.Pid} {
				if isListener(pid) {
					syscall.Kill(pid, syscall.SIGTERM)
				}
			}
			done := make(chan struct{})
			go func() { lp.cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(3 * time.Second):
				lp.cmd.Process.Kill()
				<-done
			}
			// The listener itself, if not our direct child, must be gone too.
			if isListener(lp.pid) {
				if exited, _ := pidfd.Signal(lp.pid, unix.SIGTERM, time.Second); !exited {
					pidfd.Signal(lp.pid, unix.SIGKILL, time.Second)
				}
			}
		}()
	}
	wg.Wait()
}

// isListener reports whether pid is a live `palisade-lab probe listen`.
func isListener(pid int) bool {
	if !procfs.Alive(pid) {
		return false
	}
	args := procfs.Cmdline(pid)
	for i := 1; i+1 < len(args); i++ {
		if args[i] == "probe" && args[i+1] == "listen" {
			return true
		}
	}
	return false
}

func asUser(u string) string {
	if u == "root" {
		return ""
	}
	return u
}

// connectArgv is the connector command line for p.
func (r *runner) connectArgv(p *proc) []string {
	return []string{r.tb.LabBinary, "probe", "connect", "--plan", r.planPath(p),
		"--out", filepath.Join(r.outDir(), p.tag+"-{host}.jsonl"), "--deadline", connectDeadline()}
}

func connectDeadline() string {
	if inVM() {
		return "180s"
	}
	return "60s"
}

// sshOpts: the testbed's ssh_config gives up after 5 s, banner exchange
// included; under emulation sshd's fork, PAM stack and the uvn session
// setup take longer than that.
func sshOpts() []string {
	if inVM() {
		return []string{"-o", "ConnectTimeout=90"}
	}
	return nil
}

// runAll starts every process at once and returns when all are done.
// sbatch jobs are submitted first, then waited for together.
func (r *runner) runAll(ctx context.Context, procs []*proc) {
	if len(procs) == 0 {
		return
	}
	t0 := time.Now()
	var wg sync.WaitGroup
	var jobs []*proc
	var jmu sync.Mutex
	for _, p := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if p.Launcher == Sbatch {
				if r.submit(ctx, p) {
					jmu.Lock()
					jobs = append(jobs, p)
					jmu.Unlock()
				}
				return
			}
			r.runProc(ctx, p)
		}()
	}
	wg.Wait()
	if len(jobs) > 0 {
		r.waitJobs(ctx, jobs)
	}
	var names []string
	for _, l := range Launchers {
		for _, p := range procs {
			if p.Launcher == l && !slices.Contains(names, string(l)) {
				names = append(names, string(l))
			}
		}
	}
	r.logf("%s: %d connector processes in %v", strings.Join(names, ", "), len(procs), time.Since(t0).Round(time.Millisecond))
}

// runProc runs one connector under its launcher and waits for it.
func (r *runner) runProc(ctx context.Context, p *proc) {
	argv := r.connectArgv(p)
	user := asUser(p.User)
	var cmd *exec.Cmd
	switch p.Launcher {
	case Plain:
		cmd = r.tb.Command(ctx, p.Start, user, argv...)
	case SSH:
		cmd = r.tb.Command(ctx, p.Start, user, append(append([]string{"ssh"}, sshOpts()...), p.Hosts[0], shellJoin(argv))...)
	case Srun:
		cmd = r.tb.Command(ctx, p.Start, user, append([]string{"srun", "--job-name=" + r.jobName(),
			"-N1", "-n1", "-w", p.Hosts[0]}, argv...)...)
	case MPIRun:
		mpi := []string{"mpirun", "--host", strings.Join(p.Hosts, ","), "-np", strconv.Itoa(len(p.Hosts)),
			"--map-by", "node"}
		if p.User == "root" {
			mpi = append(mpi, "--allow-run-as-root")
		}
		if inVM() {
			// orted is started over ssh: the same patience as the ssh
			// launcher.
			mpi = append(mpi, "--mca", "plm_rsh_args", strings.Join(sshOpts(), " "))
		}
		cmd = r.tb.Command(ctx, p.Start, user, append(mpi, argv...)...)
	case Queued:
		r.runQueued(ctx, p)
		return
	default:
		p.failure = fmt.Sprintf("launcher %s cannot run directly", p.Launcher)
		return
	}
	// On interrupt, let srun and mpirun cancel their job steps (SIGKILL
	// would leave the steps running until their I/O fails).
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	p.output = string(out)
	if err != nil {
		p.failure = fmt.Sprintf("%s as %s on %s: %v %s", p.Launcher, p.User, p.Start, err, summarize(p.output, 3))
	}
}

// jobName is the Slurm job name of every job of this run, so that an
// interrupted run can cancel exactly its own jobs.
func (r *runner) jobName() string {
	return "palchk-" + strings.TrimPrefix(filepath.Base(r.dir), "check-")
}

// cancelJobs cancels whatever Slurm still runs for this run.
func (r *runner) cancelJobs() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r.tb.Command(ctx, r.tb.NodeNames()[0], "", "scancel", "--name="+r.jobName()).Run()
}

// submit queues p as a batch job; false if sbatch refused it.
func (r *runner) submit(ctx context.Context, p *proc) bool {
	script := "exec " + shellJoin(r.connectArgv(p))
	cmd := r.tb.Command(ctx, p.Start, asUser(p.User), "sbatch", "--parsable", "--job-name="+r.jobName(),
		"-N1", "-n1", "-w", p.Hosts[0], "-o", filepath.Join(r.outDir(), p.tag+".slurm.out"), "--wrap", script)
	out, err := cmd.CombinedOutput()
	id, _, _ := strings.Cut(strings.TrimSpace(string(out)), ";")
	if _, perr := strconv.Atoi(id); err != nil || perr != nil {
		p.failure = fmt.Sprintf("sbatch as %s on %s: %v %s", p.User, p.Start, err, summarize(string(out), 3))
		return false
	}
	p.jobID = id
	return true
}

// waitJobs polls Slurm until none of the jobs is pending or running. On
// interrupt or timeout the jobs still there are cancelled.
func (r *runner) waitJobs(ctx context.Context, jobs []*proc) {
	ids := make([]string, len(jobs))
	for i, p := range jobs {
		ids[i] = p.jobID
	}
	start := r.tb.NodeNames()[0]
	for {
		out, err := r.tb.Command(ctx, start, "", "squeue", "-h", "-o", "%i %T", "-t", "PD,CF,R,CG,S",
			"-j", strings.Join(ids, ",")).CombinedOutput()
		active := 0
		if err == nil {
			for _, ln := range strings.Split(strings.TrimSpace(string(out)), "\n") {
				if f := strings.Fields(ln); len(f) > 0 && slices.Contains(ids, f[0]) {
					active++
				}
			}
		} else if !strings.Contains(string(out), "Invalid job id") {
			active = len(ids) // squeue itself failed: keep waiting (bounded by ctx)
		}
		if active == 0 {
			break
		}
		select {
		case <-ctx.Done():
			r.cancelJobs()
			for _, p := range jobs {
				p.failure = fmt.Sprintf("sbatch job %s cancelled: %v", p.jobID, ctx.Err())
			}
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
	for _, p := range jobs {
		b, _ := os.ReadFile(filepath.Join(r.outDir(), p.tag+".slurm.out"))
		p.output = string(b)
	}
}

// collect turns p's result files into observations.
func (r *runner) collect(p *proc) {
	files, _ := filepath.Glob(filepath.Join(r.outDir(), p.tag+"-*.jsonl"))
	starts := map[string]probe.Line{}
	done := map[string]bool{}
	results := map[string]probe.Line{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, ln := range bytes.Split(b, []byte("\n")) {
			var l probe.Line
			if len(ln) == 0 || json.Unmarshal(ln, &l) != nil {
				continue
			}
			switch l.Type {
			case "start":
				starts[l.Host] = l
			case "done":
				done[l.Host] = true
			case "result":
				results[l.ID] = l
			}
		}
	}
	why := p.failure
	if why == "" {
		why = fmt.Sprintf("%s exited without reporting", p.Launcher)
		if o := summarize(p.output, 3); o != "" {
			why += ": " + o
		}
	} else if len(results) == len(p.Cases) {
		// Everything answered, yet the launcher complained: worth
		// showing, but the cases stand on their own evidence.
		r.warn("%s", p.failure)
	}
	// Each connector also prints its done line to stdout, through the
	// launcher's own I/O path (srun exits 0 even when job I/O failed).
	ioDone := map[string]bool{}
	for _, ln := range strings.Split(p.output, "\n") {
		var l probe.Line
		if strings.HasPrefix(ln, "{") && json.Unmarshal([]byte(ln), &l) == nil && l.Type == "done" {
			ioDone[l.Host] = true
		}
	}
	wrongLaunch := map[string]string{}
	for h, st := range starts {
		if err := p.checkLaunch(st, starts); err != nil {
			wrongLaunch[h] = err.Error()
		}
	}
	for _, c := range p.Cases {
		host := c.Connector.Node
		st, started := starts[host]
		l, ok := results[c.ID]
		switch {
		case !started:
			c.Observed = Observation{State: Broken, Error: fmt.Sprintf("no connector started on %s: %s", host, why)}
		case st.Self == nil || st.Self.UID != p.Connector.UID || st.Self.GID != p.Connector.GID:
			c.Observed = Observation{State: Broken, Error: fmt.Sprintf("connector on %s ran as %+v, want uid=%d gid=%d",
				host, st.Self, p.Connector.UID, p.Connector.GID)}
		case wrongLaunch[host] != "":
			c.Observed = Observation{State: Broken, Error: fmt.Sprintf("connector on %s: %s", host, wrongLaunch[host])}
		case done[host] && !ioDone[host]:
			c.Observed = Observation{State: Broken, Error: fmt.Sprintf("%s lost the output of the connector on %s "+
				"(its results came through the shared directory, its stdout never arrived): %s",
				p.Launcher, host, summarize(p.output+"\n"+p.failure, 3))}
		case !ok && !done[host]:
			c.Observed = Observation{State: Broken, Error: fmt.Sprintf("connector on %s did not finish: %s", host, why)}
		case !ok:
			c.Observed = Observation{State: Broken, Error: "no result for this case"}
		case l.Allowed:
			c.Observed = Observation{State: Allowed, Peer: l.Peer, Micros: l.Micros}
			if l.Peer == nil || l.Peer.UID != c.Listener.UID || l.Peer.GID != c.Listener.GID || l.Peer.Host != c.Listener.Node {
				c.Observed.State = Broken
				c.Observed.Error = fmt.Sprintf("answered by %v, want uid=%d gid=%d host=%s",
					l.Peer, c.Listener.UID, c.Listener.GID, c.Listener.Node)
			}
		default:
			c.Observed = Observation{State: Refused, Kind: l.Kind, Error: l.Error, Micros: l.Micros}
		}
		// A listener that never came up makes any refusal meaningless.
		if dead, ok := r.dead[c.Listener.Node+"/"+c.Listener.Name]; ok {
			c.Observed = Observation{State: Broken, Error: fmt.Sprintf("listener %s on %s did not start: %s",
				c.Listener.Name, c.Listener.Node, dead)}
		}
	}
}

// checkLaunch verifies from the connector's environment that it really ran
// under p's launcher: a plain process has no launcher variables, ssh leaves
// SSH_CONNECTION, a Slurm step its job and step ids (a batch job: the id
// sbatch returned), and mpirun a distinct rank per node in a world of
// len(Hosts).
func (p *proc) checkLaunch(st probe.Line, all map[string]probe.Line) error {
	env := st.Self.Launch
	has := func(k string) bool { _, ok := env[k]; return ok }
	switch p.Launcher {
	case Plain:
		if len(env) > 0 {
			return fmt.Errorf("plain process has launcher environment %v", env)
		}
	case SSH:
		if !has("SSH_CONNECTION") {
			return errors.New("not started by sshd (no SSH_CONNECTION)")
		}
	case Srun:
		if !has("SLURM_JOB_ID") || !has("SLURM_STEP_ID") {
			return fmt.Errorf("not in a Slurm step (environment %v)", env)
		}
	case Sbatch:
		if env["SLURM_JOB_ID"] != p.jobID {
			return fmt.Errorf("not in batch job %s (SLURM_JOB_ID=%q)", p.jobID, env["SLURM_JOB_ID"])
		}
	case Queued:
		return p.checkQueued(env)
	case MPIRun:
		if env["OMPI_COMM_WORLD_SIZE"] != strconv.Itoa(len(p.Hosts)) || !has("OMPI_COMM_WORLD_RANK") {
			return fmt.Errorf("not an mpirun rank of %d (environment %v)", len(p.Hosts), env)
		}
		for h, o := range all {
			if h != st.Host && o.Self != nil && o.Self.Launch["OMPI_COMM_WORLD_RANK"] == env["OMPI_COMM_WORLD_RANK"] {
				return fmt.Errorf("rank %s also on %s", env["OMPI_COMM_WORLD_RANK"], h)
			}
		}
	}
	return nil
}

// summarize condenses a launcher's output for an error message: the lines
// that say "error" if any (srun, sbatch, ssh), else the first lines of what
// it printed (Open MPI's banners put the cause first), at most n, without
// banner rules and blank lines.
func summarize(s string, n int) string {
	var lines, errs []string
	for _, l := range strings.Split(s, "\n") {
		l = strings.TrimSpace(l)
		if strings.Trim(l, "-*= ") == "" {
			continue
		}
		lines = append(lines, l)
		if strings.Contains(strings.ToLower(l), "error") {
			errs = append(errs, l)
		}
	}
	if len(errs) > 0 {
		lines = errs
	}
	if len(lines) > n {
		lines = lines[:n]
	}
	return strings.Join(lines, " | ")
}

// shellJoin quotes argv for a POSIX shell (ssh, sbatch --wrap, sg -c).
func shellJoin(argv []string) string {
	q := make([]string, len(argv))
	for i, a := range argv {
		if a != "" && strings.Trim(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") == "" {
			q[i] = a
		} else {
			q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
	}
	return strings.Join(q, " ")
}

// wantUnix decides Options.Unix. Auto asks node1's agent: the cases are
// meaningful only where the BPF LSM programs are attached (this machine
// kind's kernel refuses them; the VM's 6.1/6.12 accept them).
func wantUnix(ctx context.Context, tb *testbed.Testbed, opts Options) (bool, string) {
	switch opts.Unix {
	case "on":
		return true, "--unix=on"
	case "off":
		return false, "--unix=off"
	}
	if opts.Mode != "userwall" {
		return false, "only checked in mode userwall"
	}
	out, err := tb.Command(ctx, tb.Nodes[0].Name, "", tb.Binary, "status", "--json").Output()
	var st struct {
		Unix     bool     `json:"unix_enforced"`
		Warnings []string `json:"warnings"`
	}
	// Exit status 1 is "enforcing, with warnings": the JSON is complete.
	if ee, ok := err.(*exec.ExitError); (err != nil && !(ok && ee.ExitCode() == 1)) || json.Unmarshal(out, &st) != nil {
		return false, fmt.Sprintf("no agent status on %s: %v", tb.Nodes[0].Name, err)
	}
	if !st.Unix {
		for _, w := range st.Warnings {
			if strings.Contains(w, "Unix") {
				return false, w
			}
		}
		return false, "the agent on " + tb.Nodes[0].Name + " does not enforce them"
	}
	return true, "the agent on " + tb.Nodes[0].Name + " enforces them (BPF LSM)"
}
