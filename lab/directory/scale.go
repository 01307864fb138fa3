package directory

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	"github.com/palisade-hpc/palisade/internal/sys/procfs"
	userwalllab "github.com/palisade-hpc/palisade/lab/modes/userwall"
	"github.com/palisade-hpc/palisade/lab/testbed"
)

// Figures are one directory size's measurements on the listener node
// (node2) of a 2-node userwall testbed with --directory ldap.
type Figures struct {
	Users, Groups     int           // directory size
	HeldGroups        int           // gids held by processes on node2 (what the agent looks up)
	AgentRSSKiB       int           // agent resident memory after the load settled
	MapEntries        int           // (uid, gid) entries in node2's members map
	SearchesPerMin    float64       // LDAP searches from node2 (slapd log) per minute, steady state
	LoadWindow        time.Duration // over this window
	ChangeApplied     time.Duration // ldapmodify (member out) → the cross-node connection refused
	ConnectMedianUS   int           // TCP connect (cross-node, shared group, allowed): median µs of 200
	SettleAfterGroups time.Duration // processes holding HeldGroups gids started → all in the map
}

// session is a listener or holder process started for the measurement.
type session struct{ stop func() }

// asIDs runs argv on node as root dropping to uid/gid (no account needed:
// synthetic users exist only in the directory).
func asIDs(uid, gid uint32, argv ...string) []string {
	return append([]string{"setpriv", "--reuid=" + strconv.Itoa(int(uid)), "--regid=" + strconv.Itoa(int(gid)), "--clear-groups", "--"}, argv...)
}

func start(ctx context.Context, tb *testbed.Testbed, node string, argv []string, ready string) (*session, error) {
	ctx, cancel := context.WithCancel(ctx)
	cmd := tb.Command(ctx, node, "", argv...)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		cancel()
		return nil, err
	}
	s := &session{stop: func() { stdin.Close(); cancel(); cmd.Wait() }}
	if ready != "" {
		if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || !strings.Contains(line, ready) {
			s.stop()
			return nil, fmt.Errorf("%v: %q %v", argv, line, err)
		}
	}
	return s, nil
}

var usRE = regexp.MustCompile(`"allowed":true.*"us":(\d+)`)

// connect probes the listener from node1 as uid/gid; allowed and µs.
func connect(ctx context.Context, tb *testbed.Testbed, uid, gid uint32, target string) (bool, int, error) {
	out, err := tb.Output(ctx, "node1", "", asIDs(uid, gid, tb.LabBinary, "probe", "connect", target)...)
	if err != nil {
		return false, 0, err
	}
	if m := usRE.FindStringSubmatch(out); m != nil {
		us, _ := strconv.Atoi(m[1])
		return true, us, nil
	}
	return false, 0, nil
}

// searchesFrom counts slapd's SRCH operations on connections from addr
// in the log lines after offset.
func searchesFrom(log string, offset int64, addr string) (int, int64, error) {
	f, err := os.Open(log)
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	st, _ := f.Stat()
	if _, err := f.Seek(offset, 0); err != nil {
		return 0, 0, err
	}
	conns := map[string]bool{}
	// Connections opened before offset: find them from the start.
	all, _ := os.ReadFile(log)
	for _, l := range strings.Split(string(all), "\n") {
		if strings.Contains(l, " ACCEPT from IP="+addr+":") {
			conns[strings.Fields(l)[2]] = true
		}
	}
	n := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) > 4 && conns[f[2]] && f[4] == "SRCH" {
			n++
		}
	}
	return n, st.Size(), sc.Err()
}

// Measure runs the scale measurement on a 2-node userwall testbed with
// --directory ldap and --directory-users users (0: the 4 test users).
// held is how many directory groups processes on node2 hold (the agent
// looks up each one's member list).
func Measure(ctx context.Context, name string, users, held int, window time.Duration) (*Figures, error) {
	_ = testbed.Down(ctx, name)
	tb, err := testbed.Up(ctx, testbed.Options{Name: name, Nodes: 2, Mode: userwalllab.ModeName,
		Directory: testbed.DirectoryLDAP, DirectoryUsers: users})
	if err != nil {
		return nil, err
	}
	defer testbed.Down(context.WithoutCancel(ctx), name)
	fig := &Figures{Users: users + len(testbed.Users), Groups: len(testbed.Users) + 2}
	if users > 0 {
		fig.Groups += users + max(1, users/5)
	}
	var sessions []*session
	defer func() {
		for _, s := range sessions {
			s.stop()
		}
	}()
	// The listener and the connector that share a group, and the member
	// the change removes: alice/bob/proj1, or synthetic u0/u<step>/g0.
	lisUID, lisGID, conUID, conGID := uint32(2001), uint32(testbed.ProjectGID), uint32(2002), uint32(2002)
	groupDN, member := "cn="+testbed.ProjectGroup+",ou=groups,"+testbed.LDAPBase, "bob"
	var gids []uint32
	if users > 0 {
		groups := max(1, users/5)
		step := groups / min(testbed.SynthGroupsPerUser, groups)
		// User groups-step is in g0 (k=1: groups-step+step ≡ 0).
		c := groups - step
		lisUID, lisGID = testbed.SynthUIDBase, testbed.SynthGIDBase
		conUID, conGID = uint32(testbed.SynthUIDBase+c), uint32(testbed.SynthUIDBase+c)
		groupDN, member = "cn=g0,ou=groups,"+testbed.LDAPBase, "u"+strconv.Itoa(c)
		for j := 1; j < held && j < groups; j++ {
			gids = append(gids, uint32(testbed.SynthGIDBase+j))
		}
	}
	pinDir, err := userwalllab.NodePinDir(tb, "node2")
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	for _, g := range gids {
		s, err := start(ctx, tb, "node2", asIDs(lisUID, g, "sleep", "3600"), "")
		if err != nil {
			return nil, err
		}
		sessions = append(sessions, s)
	}
	l, err := start(ctx, tb, "node2", asIDs(lisUID, lisGID, tb.LabBinary, "probe", "listen", "--ports", "29600",
		"--exit-on-stdin-eof", "--lifetime", "1h"), `"ready"`)
	if err != nil {
		return nil, err
	}
	sessions = append(sessions, l)
	fig.HeldGroups = len(gids) + 1
	if err := userwalllab.WaitMembers(ctx, tb, "node2", []kernel.MemberPair{{UID: conUID, GID: lisGID}}, 5*time.Minute); err != nil {
		return nil, err
	}
	// Every held group looked up: the map stops growing.
	prev := -1
	for {
		n, err := kernel.CountMembers(pinDir)
		if err != nil {
			return nil, err
		}
		if n == prev {
			break
		}
		prev = n
		time.Sleep(testbed.GroupRefresh) // one refresh round; the count is the acknowledgement
	}
	fig.SettleAfterGroups = time.Since(t0)
	fig.MapEntries = prev
	target := "tcp:" + tb.Nodes[1].Eth0V4.String() + ":29600"
	var lat []int
	for range 200 {
		ok, us, err := connect(ctx, tb, conUID, conGID, target)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, fmt.Errorf("uid %d refused by its group's listener", conUID)
		}
		lat = append(lat, us)
	}
	slices.Sort(lat)
	fig.ConnectMedianUS = lat[len(lat)/2]
	// Steady-state directory load from node2.
	_, off, err := searchesFrom(tb.SlapdLog(), 0, tb.Nodes[1].Eth0V4.String())
	if err != nil {
		return nil, err
	}
	select {
	case <-time.After(window):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	n, _, err := searchesFrom(tb.SlapdLog(), off, tb.Nodes[1].Eth0V4.String())
	if err != nil {
		return nil, err
	}
	fig.SearchesPerMin, fig.LoadWindow = float64(n)/window.Minutes(), window
	pid, _ := os.ReadFile(filepath.Join(tb.RunDir(), "node2", "agent.pid"))
	if p, err := strconv.Atoi(strings.TrimSpace(string(pid))); err == nil {
		if rss, _, ok := procfs.Memory(p); ok {
			fig.AgentRSSKiB = int(rss / 1024)
		}
	}
	// A membership change: the connector out of the group.
	if err := tb.LDAPModify(ctx, "dn: "+groupDN+"\nchangetype: modify\ndelete: memberUid\nmemberUid: "+member+"\n"); err != nil {
		return nil, err
	}
	t1 := time.Now()
	for {
		ok, _, err := connect(ctx, tb, conUID, conGID, target)
		if err != nil {
			return nil, err
		}
		if !ok {
			break
		}
		if time.Since(t1) > 5*time.Minute {
			return nil, fmt.Errorf("membership change not applied after 5 min")
		}
		time.Sleep(100 * time.Millisecond) // sampling the kernel's decision
	}
	fig.ChangeApplied = time.Since(t1)
	return fig, nil
}

// Table renders figures as a Markdown table.
func Table(figs ...*Figures) string {
	var b strings.Builder
	b.WriteString("| directory | groups held on node | agent RSS | members map entries | LDAP searches/min from node (steady) | membership change applied | TCP connect median (shared group, cross-node) | all held groups loaded |\n|---|---|---|---|---|---|---|---|\n")
	for _, f := range figs {
		fmt.Fprintf(&b, "| %d users, %d groups | %d | %.1f MiB | %d | %.1f (over %v) | %.1f s | %d µs | %.1f s |\n",
			f.Users, f.Groups, f.HeldGroups, float64(f.AgentRSSKiB)/1024, f.MapEntries, f.SearchesPerMin, f.LoadWindow,
			f.ChangeApplied.Seconds(), f.ConnectMedianUS, f.SettleAfterGroups.Seconds())
	}
	return b.String()
}
