package userwall

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/control"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"

	"github.com/cilium/ebpf"
)

// reloadNode runs `palisade agent --reload` on node: it returns once the
// agent applied or refused the file (the agent acknowledges in its state).
func reloadNode(t *testing.T, node string) (string, error) {
	t.Helper()
	n, _ := tb.Node(node)
	out, err := nodeCommand(context.Background(), tb, n, "agent", "--reload").CombinedOutput()
	return string(out), err
}

// metrics fetches node's metrics from addr inside the node ("" and an error
// when nothing serves there).
func metrics(node, addr string) (string, error) {
	return tb.Output(context.Background(), node, "", "/usr/bin/python3", "-c",
		"import urllib.request; print(urllib.request.urlopen('http://"+addr+"/metrics', timeout=5).read().decode())")
}

func fileSHA(t *testing.T, path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// eventsIn reads a JSON-lines event log for connector→listener port events.
func eventsIn(path, connector string, port string) int {
	b, _ := os.ReadFile(path)
	return strings.Count(string(b), `"user":"`+connector+`"`) * strings.Count(string(b), ":"+port+`"`)
}

// TestReloadAppliesEverySetting: a reload moves the metrics, the event log
// and the ident port, counts a generation and changes the configuration
// hash; the event log is reopened on every reload (logrotate); a setting
// that needs a restart is refused whole, with its name, and reported.
func TestReloadAppliesEverySetting(t *testing.T) {
	needTestbed(t)
	const node = "node1"
	p := tb.ConfigPath(node)
	orig, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.WriteFile(p, orig, 0o644)
		if out, err := reloadNode(t, node); err != nil {
			t.Errorf("restoring the configuration: %v %s", err, out)
		}
	})
	before := status(t, node)
	if before.Agent == nil || before.Agent.ConfigSHA != fileSHA(t, p) || before.Agent.Version == "" {
		t.Fatalf("status lacks the agent's state or hash: %+v", before.Agent)
	}
	listen(t, node, "alice", "tcp", "0.0.0.0", 5181)

	newLog := filepath.Join(tb.LogDir(), "pal-reload-events.jsonl")
	os.Remove(newLog)
	t.Cleanup(func() { os.Remove(newLog) })
	conf := regexp.MustCompile(`(?m)^event_log = .*$`).ReplaceAllString(string(orig), "event_log = \""+newLog+"\"") +
		"metrics_address = \"127.0.0.1:9471\"\nident_port = 98\ngroup_refresh = \"7s\"\n"
	if err := os.WriteFile(p, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := reloadNode(t, node); err != nil || !strings.Contains(out, "configuration reloaded") {
		t.Fatalf("reload: %v %s", err, out)
	}
	after := status(t, node)
	if after.Agent.Generation != before.Agent.Generation+1 || after.Agent.ConfigSHA != fileSHA(t, p) || after.Agent.LastReloadError != "" {
		t.Errorf("state after reload: %+v (before: generation %d)", after.Agent, before.Agent.Generation)
	}
	// Metrics moved, with the new identity.
	m, err := metrics(node, "127.0.0.1:9471")
	if err != nil {
		t.Fatalf("metrics not on the new address: %v", err)
	}
	for _, want := range []string{`palisade_config_info{path="` + p + `",sha256="` + fileSHA(t, p) + `"} 1`,
		"palisade_config_last_reload_success 1", "palisade_config_generation " + strconv.FormatUint(after.Agent.Generation, 10)} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	if _, err := metrics(node, "127.0.0.1:9464"); err == nil {
		t.Errorf("metrics still served on the old address")
	}
	// The ident service moved to UDP 98.
	if out, _ := tb.Output(context.Background(), node, "", "ss", "-Hlnu", "sport = :98"); !strings.Contains(out, ":98") {
		t.Errorf("ident not listening on UDP 98: %q", out)
	}
	if out, _ := tb.Output(context.Background(), node, "", "ss", "-Hlnu", "sport = :99"); strings.Contains(out, ":99") {
		t.Errorf("ident still on UDP 99: %q", out)
	}
	// Refusals go to the new event log.
	run(t, []tcase{{node, "carol", "tcp", "127.0.0.1", 5181, refused, nil}})
	waitFor(t, "event in the new log", func() bool { return eventsIn(newLog, "carol", "5181") > 0 })

	// logrotate: the file is moved away, SIGHUP (a reload of the same
	// file) makes the agent write to a new file at the configured path.
	rotated := newLog + ".1"
	t.Cleanup(func() { os.Remove(rotated) })
	if err := os.Rename(newLog, rotated); err != nil {
		t.Fatal(err)
	}
	if out, err := reloadNode(t, node); err != nil {
		t.Fatalf("reload after rotation: %v %s", err, out)
	}
	n0 := eventsIn(rotated, "carol", "5181")
	run(t, []tcase{{node, "carol", "tcp", "127.0.0.1", 5181, refused, nil}})
	waitFor(t, "event in the reopened log", func() bool { return eventsIn(newLog, "carol", "5181") > 0 })
	if n := eventsIn(rotated, "carol", "5181"); n != n0 {
		t.Errorf("the rotated file still receives events (%d → %d)", n0, n)
	}

	// A setting fixed for the agent's life: refused whole, named.
	gen := status(t, node).Agent.Generation
	os.WriteFile(p, []byte(conf+"bpffs = \"/sys/fs/bpf/palelsewhere\"\n"), 0o644)
	out, err := reloadNode(t, node)
	if err == nil || !strings.Contains(out, "agent.bpffs") || !strings.Contains(out, "needs a restart") {
		t.Errorf("reload changing bpffs: err %v, output %q", err, out)
	}
	s := status(t, node)
	if s.Agent.Generation != gen || !strings.Contains(s.Agent.LastReloadError, "agent.bpffs") {
		t.Errorf("refused reload: generation %d → %d, error %q", gen, s.Agent.Generation, s.Agent.LastReloadError)
	}
	if !hasWarning(s, "was refused") || !hasWarning(s, "changed since the agent applied it") {
		t.Errorf("status warnings after a refused reload: %q", s.Warnings)
	}
	if m, _ := metrics(node, "127.0.0.1:9471"); !strings.Contains(m, "palisade_config_last_reload_success 0") {
		t.Errorf("metrics do not show the refused reload")
	}
}

func hasWarning(s *control.Status, text string) bool {
	for _, w := range s.Warnings {
		if strings.Contains(w, text) {
			return true
		}
	}
	return false
}

// waitFor polls cond (the event log is written asynchronously from the
// ring buffer) for up to 5 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Errorf("timed out waiting for %s", what)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestStatusAsUser: a user who may not read the kernel objects gets the
// agent's view (mode userwall, its version and configuration), never
// "none"; the exit status says "enforcing, with warnings" or "enforcing".
func TestStatusAsUser(t *testing.T) {
	needTestbed(t)
	root := status(t, "node1")
	cmd := tb.Command(context.Background(), "node1", "alice", tb.Binary, "status", "--config", tb.ConfigPath("node1"))
	out, err := cmd.CombinedOutput()
	code := 0
	if err != nil {
		code = cmd.ProcessState.ExitCode()
	}
	if code != 0 && code != 1 || !strings.Contains(string(out), "mode:        userwall") ||
		!strings.Contains(string(out), "source:      the agent's state (") || !strings.Contains(string(out), root.Agent.ConfigSHA) {
		t.Errorf("status as alice: exit %d\n%s", code, out)
	}
	if (code == 1) != (len(root.Warnings) > 0) {
		t.Errorf("status as alice exits %d; root sees warnings %q", code, root.Warnings)
	}
	// --check: nothing printed, the same verdict.
	cmd = tb.Command(context.Background(), "node1", "alice", tb.Binary, "status", "--check", "--config", tb.ConfigPath("node1"))
	out, _ = cmd.CombinedOutput()
	if len(out) != 0 || cmd.ProcessState.ExitCode() != code {
		t.Errorf("status --check as alice: exit %d, output %q", cmd.ProcessState.ExitCode(), out)
	}
}

// TestSlurmAccountsMustBeExempt: with only root (and svc) exempt — the
// defaults a site starts from — a reload is refused (config check's
// ERROR); an agent started with it makes Slurm's own account a user to
// userwall and `sinfo` fails; `config check` on the node says so, naming the line to
// add; with "slurm" exempt both ways Slurm works again.
func TestSlurmAccountsMustBeExempt(t *testing.T) {
	needTestbed(t)
	origs := map[string][]byte{}
	for _, n := range tb.Nodes {
		p := tb.ConfigPath(n.Name)
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		origs[n.Name] = b
	}
	restore := func() {
		for name, b := range origs {
			os.WriteFile(tb.ConfigPath(name), b, 0o644)
			if out, err := reloadNode(t, name); err != nil {
				t.Errorf("%s: restoring the configuration: %v %s", name, err, out)
			}
		}
	}
	t.Cleanup(restore)
	for name, b := range origs {
		c := regexp.MustCompile(`(?m)^(exempt_(connectors|listeners)) = .*$`).ReplaceAllString(string(b), `$1 = ["root", "svc"]`)
		if c == string(b) {
			t.Fatalf("%s: exemptions not found in the testbed configuration", name)
		}
		os.WriteFile(tb.ConfigPath(name), []byte(c), 0o644)
		// config check's ERROR: a reload is refused, the running
		// configuration stays; an agent that starts with it enforces it.
		if out, err := reloadNode(t, name); err == nil || !strings.Contains(out, `SlurmUser "slurm"`) {
			t.Errorf("%s: reload without Slurm's account exempt: %v %s", name, err, out)
		}
		restartAgent(t, name)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, _ := tb.Command(ctx, "node2", "alice", "sinfo", "-h", "-o", "%P").CombinedOutput()
	if !strings.Contains(string(out), "Unable to contact slurm controller") {
		t.Errorf("sinfo as alice without Slurm's account exempt: %q", out)
	}
	// config check as the node sees it (its /etc/slurm/slurm.conf).
	cmd := tb.Command(ctx, "node1", "", tb.Binary, "config", "check", "--config", tb.ConfigPath("node1"))
	out, err := cmd.CombinedOutput()
	if err == nil || cmd.ProcessState.ExitCode() != 1 ||
		!regexp.MustCompile(`# ERROR: \S+:\d+: policy\.exempt_connectors: SlurmUser "slurm" \(/etc/slurm/slurm.conf:\d+\) is not in exempt_connectors and exempt_listeners`).Match(out) {
		t.Errorf("config check without Slurm's account: %v\n%s", err, out)
	}
	restore()
	out, err = tb.Command(ctx, "node2", "alice", "sinfo", "-h", "-o", "%P").CombinedOutput()
	if err != nil || strings.Contains(string(out), "Unable to contact") || strings.TrimSpace(string(out)) == "" {
		t.Errorf("sinfo as alice with Slurm's account exempt: %v %q", err, out)
	}
	cmd = tb.Command(ctx, "node1", "", tb.Binary, "config", "check", "--config", tb.ConfigPath("node1"))
	if out, err := cmd.CombinedOutput(); err != nil || strings.Contains(string(out), "# ERROR") {
		t.Errorf("config check with Slurm's account exempt: %v\n%s", err, out)
	}
}

// TestExplainAgreesWithKernel: explain never answers DENY for a connection
// the kernel allows — as a user who cannot see the listener's group it says
// "undecided" — and for a refused one it names the fix.
func TestExplainAgreesWithKernel(t *testing.T) {
	needTestbed(t)
	listen(t, "node1", "bob+proj1", "tcp", "0.0.0.0", 5191) // shared with proj1
	listen(t, "node1", "bob", "tcp", "0.0.0.0", 5192)       // private
	run(t, []tcase{
		{"node1", "alice", "tcp", "127.0.0.1", 5191, "OK", nil},
		{"node1", "alice", "tcp", "127.0.0.1", 5192, refused, nil},
	})
	explain := func(user string, args ...string) string {
		cmd := tb.Command(context.Background(), "node1", user, append([]string{tb.Binary, "explain", "--config", tb.ConfigPath("node1")}, args...)...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("explain %v as %q: %v\n%s", args, user, err, out)
		}
		return string(out)
	}
	// As alice herself (her own credentials): allowed or undecided, never DENY.
	out := explain("alice", "--to", "127.0.0.1:5191")
	if strings.Contains(out, "DENY") || !(strings.Contains(out, "ALLOW (rule shared-group)") || strings.Contains(out, "undecided")) {
		t.Errorf("alice → bob's proj1 listener (the kernel allows):\n%s", out)
	}
	// Root sees the listener's group: the kernel's verdicts, and the fix.
	out = explain("", "--from", "alice", "--to", "127.0.0.1:5191")
	if !strings.Contains(out, "ALLOW (rule shared-group)") {
		t.Errorf("root: alice → bob's proj1 listener:\n%s", out)
	}
	out = explain("", "--from", "alice", "--to", "127.0.0.1:5192")
	if !strings.Contains(out, "DENY (rule default-deny)") || !strings.Contains(out, "ask bob to share the service with a group you both hold: sg proj1") {
		t.Errorf("root: alice → bob's private listener:\n%s", out)
	}
}

// TestUpgradeWithoutGap replaces node1's agent by a newer build, as the
// package's postinst does (stop, new binary, start): the new version adopts
// the pinned programs and maps (the same map objects: no migration), and
// during the whole replacement no refused connection gets through and no
// allowed one fails.
func TestUpgradeWithoutGap(t *testing.T) {
	needTestbed(t)
	const next = "9.9.9~upgrade"
	u := newUpgrader(t)
	listenBoth(t, 5197)
	before := status(t, "node1")
	ids := pinnedMapIDs(t, before.PinDir)
	u.replaceUnderTraffic(t, buildAgent(t, next), 5197)
	after := status(t, "node1")
	// Same layout: every map adopted as it is, no migration.
	if now := pinnedMapIDs(t, after.PinDir); !maps.Equal(now, ids) {
		t.Errorf("pinned maps %v → %v", ids, now)
	}
	if log, _ := os.ReadFile(filepath.Join(tb.LogDir(), "node1-agent.log")); strings.Contains(string(log[u.logAt:]), "migrat") {
		t.Errorf("a same-layout upgrade migrated:\n%s", log[u.logAt:])
	}
	if after.Agent == nil || after.Agent.Version != next || after.Agent.Version == before.Agent.Version {
		t.Errorf("after the upgrade the agent reports %+v (before: %s)", after.Agent, before.Agent.Version)
	}
	if len(after.Links) != len(before.Links) {
		t.Errorf("links %d → %d", len(before.Links), len(after.Links))
	}
	// The agent logs its version at start.
	if log, _ := os.ReadFile(filepath.Join(tb.LogDir(), "node1-agent.log")); !strings.Contains(string(log), `msg="palisade agent starting" version=`+next) {
		t.Errorf("node1's agent log lacks its start line with version %s", next)
	}
}

// TestUpgradeChangedLayout: N → N+1 whose maps have another layout (build
// tag palisade_layout_next: sk_owners gets another flag, counters and
// exempt_conn another max_entries) → N again, each under continuous local
// and cross-node TCP and UDP traffic: no refused attempt gets through, no
// allowed one fails. The changed maps are replaced (new IDs, old ones
// freed), the unchanged ones kept (same IDs), the counters carried over,
// every link keeps its pin and runs the new program (the old programs are
// freed), and nothing is left under next/. Both with tcx links and with tc
// filters (tc_attach = "tc", kernels before 6.6).
func TestUpgradeChangedLayout(t *testing.T) {
	needTestbed(t)
	const next = "9.9.9~layout"
	u := newUpgrader(t)
	regular := u.old
	variant := buildAgent(t, next, "palisade_layout_next")
	changed := map[string]bool{"sk_owners": true, "counters": true, "exempt_conn": true}
	listenBoth(t, 5198)
	for _, attach := range []string{"tcx", "tc"} {
		t.Run(attach, func(t *testing.T) {
			if attach == "tc" {
				useTCAttach(t, u)
			}
			for _, step := range []struct {
				name string
				bin  []byte
				// the map only N+1 has: pinned at commit, pin removed by N
				added, dropped string
			}{{"N → N+1 (changed layout)", variant, kernel.LayoutNextMap, ""},
				{"N+1 → N (downgrade, changed layout)", regular, "", kernel.LayoutNextMap}} {
				before := status(t, "node1")
				ids := pinnedMapIDs(t, before.PinDir)
				var total uint64
				for _, c := range before.Counters {
					total += c.Count
				}
				u.replaceUnderTraffic(t, step.bin, 5198)
				after := status(t, "node1")
				if after.Agent == nil || after.Agent.PID == before.Agent.PID || after.PinDir != before.PinDir {
					t.Fatalf("%s: agent after: %+v", step.name, after.Agent)
				}
				log, _ := os.ReadFile(filepath.Join(tb.LogDir(), "node1-agent.log"))
				if !strings.Contains(string(log[u.logAt:]), "migration committed") {
					t.Errorf("%s: the agent log does not say it migrated:\n%s", step.name, log[u.logAt:])
				}
				now := pinnedMapIDs(t, after.PinDir)
				for name, id := range ids {
					switch {
					case name == step.dropped:
						if now[name] != 0 || !gone(func() bool { return !mapExists(id) }) {
							t.Errorf("%s: map %s (not in this version) still pinned (%d) or allocated (%d)", step.name, name, now[name], id)
						}
					case now[name] == 0:
						t.Errorf("%s: map %s no longer pinned", step.name, name)
					case changed[name] && now[name] == id:
						t.Errorf("%s: map %s (changed layout) still the old one (id %d)", step.name, name, id)
					case changed[name] && !gone(func() bool { return !mapExists(id) }):
						t.Errorf("%s: old map %s (id %d) still exists", step.name, name, id)
					case !changed[name] && now[name] != id:
						t.Errorf("%s: map %s (same layout) replaced: id %d → %d", step.name, name, id, now[name])
					}
				}
				if step.added != "" && now[step.added] == 0 {
					t.Errorf("%s: map %s (new in this version) not pinned", step.name, step.added)
				}
				want := len(ids)
				if step.added != "" {
					want++
				}
				if step.dropped != "" {
					want--
				}
				if len(now) != want {
					t.Errorf("%s: pinned maps %v → %v", step.name, ids, now)
				}
				if _, err := os.Stat(filepath.Join(after.PinDir, "next")); !os.IsNotExist(err) {
					t.Errorf("%s: staging directory left behind: %v", step.name, err)
				}
				var total2 uint64
				for _, c := range after.Counters {
					total2 += c.Count
				}
				if total2 < total {
					t.Errorf("%s: counters not carried over: total %d → %d", step.name, total, total2)
				}
				checkLinksReplaced(t, step.name, before, after)
				checkNoLeaks(t, step.name, after)
			}
		})
	}
}

// TestUpgradeRollback: a changed-layout upgrade that fails half-way (a
// test build fails on purpose after the cgroup link connect6 switched, or
// after every link switched, just before commit) rolls back: the agent
// exits with the reason, every link runs its old program again, the pinned
// maps are the old ones, next/ is gone, and traffic was decided right
// throughout; the old version then starts on what it left. With tcx links
// and with tc filters.
func TestUpgradeRollback(t *testing.T) {
	needTestbed(t)
	u := newUpgrader(t)
	variant := buildAgent(t, "9.9.9~fault", "palisade_layout_next")
	listenBoth(t, 5199)
	for _, attach := range []string{"tcx", "tc"} {
		t.Run(attach, func(t *testing.T) {
			if attach == "tc" {
				useTCAttach(t, u)
			}
			before := status(t, "node1")
			mapIDs := pinnedMapIDs(t, before.PinDir)
			progs := map[string]uint32{}
			for _, l := range before.Links {
				progs[l.Name] = l.ProgID
			}
			underTraffic(t, 5199, func() {
				u.replace(t, variant)
				if err := TermAgent(tb, "node1"); err != nil {
					t.Error(err)
				}
				for _, stage := range []string{"cgroup:connect6", "commit"} {
					cmd := nodeCommand(context.Background(), tb, tb.Nodes[0], "agent")
					cmd.Env = append(cmd.Env, "PALISADE_MIGRATION_FAULT="+stage)
					out, err := cmd.CombinedOutput()
					if err == nil || !strings.Contains(string(out), "migration rolled back") || !strings.Contains(string(out), "injected fault at "+stage) {
						t.Errorf("%s: agent: %v\n%s", stage, err, out)
					}
					if !strings.Contains(string(out), "pinned maps have another layout: migrating") {
						t.Errorf("%s: the agent did not migrate:\n%s", stage, out)
					}
					after := status(t, "node1")
					for _, l := range after.Links {
						if progs[l.Name] != l.ProgID {
							t.Errorf("%s: link %s runs program %d, before %d", stage, l.Name, l.ProgID, progs[l.Name])
						}
					}
					if len(after.Links) != len(before.Links) {
						t.Errorf("%s: links %d → %d", stage, len(before.Links), len(after.Links))
					}
					if now := pinnedMapIDs(t, before.PinDir); !maps.Equal(now, mapIDs) {
						t.Errorf("%s: pinned maps %v, before %v", stage, now, mapIDs)
					}
					if _, err := os.Stat(filepath.Join(before.PinDir, "next")); !os.IsNotExist(err) {
						t.Errorf("%s: staging directory left behind: %v", stage, err)
					}
					checkNoLeaks(t, stage, after)
				}
				u.replace(t, u.old)
				u.restart(t)
			})
			log, _ := os.ReadFile(filepath.Join(tb.LogDir(), "node1-agent.log"))
			if strings.Contains(string(log[u.logAt:]), "migrating") {
				t.Errorf("the old version migrated after the rollbacks (it should find its own layout):\n%s", log[u.logAt:])
			}
		})
	}
}

// useTCAttach restarts node1's agent with tc_attach = "tc" (clsact
// filters instead of tcx links) until the test ends.
func useTCAttach(t *testing.T, u *upgrader) {
	t.Helper()
	p := tb.ConfigPath("node1")
	orig := must(os.ReadFile(p))
	conf := strings.Replace(string(orig), "[agent]\n", "[agent]\ntc_attach = \"tc\"\n", 1)
	if conf == string(orig) {
		t.Fatal("no [agent] table in node1's configuration")
	}
	os.WriteFile(p, []byte(conf), 0o644)
	t.Cleanup(func() {
		os.WriteFile(p, orig, 0o644)
		u.restart(t)
	})
	u.restart(t)
	if s := status(t, "node1"); s.Attach != "tc" {
		t.Fatalf("node1 with tc_attach = \"tc\": attach %q", s.Attach)
	}
}

// checkNoLeaks: the programs that use node1's settings map are exactly the
// ones its links and filters run (none of an earlier or failed agent is
// left: no iterator, no staged program), and each such program is in as
// many kernel links as status lists (no doubled owner recorder left).
func checkNoLeaks(t *testing.T, step string, st *control.Status) {
	t.Helper()
	settings := pinnedMapIDs(t, st.PinDir)["settings"]
	want := map[uint32]bool{}
	linksOf := map[uint32]int{}
	for _, l := range st.Links {
		want[l.ProgID] = true
		if l.Type != "tc" {
			linksOf[l.ProgID]++
		}
	}
	var extra []string
	ok := gone(func() bool {
		out, err := exec.Command("bpftool", "prog", "show", "-j").Output()
		if err != nil {
			t.Fatalf("bpftool prog show: %v", err)
		}
		var progs []struct {
			ID     uint32       `json:"id"`
			Name   string       `json:"name"`
			MapIDs []ebpf.MapID `json:"map_ids"`
		}
		if err := json.Unmarshal(out, &progs); err != nil {
			t.Fatal(err)
		}
		extra = nil
		for _, p := range progs {
			if slices.Contains(p.MapIDs, settings) && !want[p.ID] {
				extra = append(extra, fmt.Sprintf("%s (id %d)", p.Name, p.ID))
			}
		}
		return len(extra) == 0
	})
	if !ok {
		t.Errorf("%s: programs using node1's maps beyond its links: %v", step, extra)
	}
	out, err := exec.Command("bpftool", "link", "show", "-j").Output()
	if err != nil {
		t.Fatalf("bpftool link show: %v", err)
	}
	var links []struct {
		ID     uint32 `json:"id"`
		ProgID uint32 `json:"prog_id"`
	}
	if err := json.Unmarshal(out, &links); err != nil {
		t.Fatal(err)
	}
	got := map[uint32]int{}
	for _, l := range links {
		if want[l.ProgID] {
			got[l.ProgID]++
		}
	}
	if !maps.Equal(got, linksOf) {
		t.Errorf("%s: kernel links per program %v, status lists %v", step, got, linksOf)
	}
}

// listenBoth starts alice's TCP and UDP listeners on node1 (all addresses).
func listenBoth(t *testing.T, port int) {
	listen(t, "node1", "alice", "tcp", "::", port)
	listen(t, "node1", "alice", "udp", "::", port)
}

// gone polls cond for up to 5 s: the kernel frees a program and its maps
// after an RCU grace period and a work item once the last reference goes,
// and nothing acknowledges that.
func gone(cond func() bool) bool {
	for deadline := time.Now().Add(5 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true
}

// pinnedMapIDs: the IDs of the maps pinned in dir, by name.
func pinnedMapIDs(t *testing.T, dir string) map[string]ebpf.MapID {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]ebpf.MapID{}
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, e.Name()), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			t.Fatalf("pinned map %s: %v", e.Name(), err)
		}
		info, err := m.Info()
		m.Close()
		if err != nil {
			t.Fatal(err)
		}
		id, _ := info.ID()
		out[e.Name()] = id
	}
	return out
}

func mapExists(id ebpf.MapID) bool {
	m, err := ebpf.NewMapFromID(id)
	if err != nil {
		return false
	}
	m.Close()
	return true
}

// checkLinksReplaced: the same link pins, each on a new program; the old
// programs are gone from the kernel (bpftool does not find them).
func checkLinksReplaced(t *testing.T, step string, before, after *control.Status) {
	t.Helper()
	prog := map[string]uint32{}
	for _, l := range after.Links {
		prog[l.Name] = l.ProgID
	}
	for _, l := range before.Links {
		id, ok := prog[l.Name]
		switch {
		case !ok:
			t.Errorf("%s: link %s gone", step, l.Name)
		case id == l.ProgID:
			t.Errorf("%s: link %s still runs the old program %d", step, l.Name, id)
		default:
			show := func() error {
				return exec.Command("bpftool", "prog", "show", "id", strconv.Itoa(int(l.ProgID))).Run()
			}
			if !gone(func() bool { return show() != nil }) {
				out, _ := exec.Command("bpftool", "prog", "show", "id", strconv.Itoa(int(l.ProgID))).CombinedOutput()
				t.Errorf("%s: old program %d of %s still loaded: %s", step, l.ProgID, l.Name, out)
			}
		}
	}
	if len(after.Links) != len(before.Links) {
		t.Errorf("%s: links %d → %d", step, len(before.Links), len(after.Links))
	}
}

// buildAgent builds the palisade binary with version v and build tags.
func buildAgent(t *testing.T, v string, tags ...string) []byte {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "palisade")
	args := []string{"build", "-ldflags", "-X github.com/palisade-hpc/palisade/internal/version.version=" + v, "-o", bin}
	if len(tags) > 0 {
		args = append(args, "-tags", strings.Join(tags, ","))
	}
	build := exec.Command("go", append(args, "github.com/palisade-hpc/palisade/cmd/palisade")...)
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building %s: %v\n%s", v, err, out)
	}
	return must(os.ReadFile(bin))
}

// upgrader replaces node1's agent binary and restarts it as the package's
// postinst does (stop, new binary, start); the test's end restores the
// original binary and restarts that.
type upgrader struct {
	old   []byte
	logAt int // length of node1's agent log at the last restart
}

func newUpgrader(t *testing.T) *upgrader {
	u := &upgrader{old: must(os.ReadFile(tb.Binary))}
	t.Cleanup(func() { u.replace(t, u.old); u.restart(t) })
	return u
}

func (u *upgrader) replace(t *testing.T, b []byte) {
	t.Helper()
	if err := os.WriteFile(tb.Binary+".new", b, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tb.Binary+".new", tb.Binary); err != nil {
		t.Fatal(err)
	}
}

func (u *upgrader) restart(t *testing.T) {
	t.Helper()
	if err := TermAgent(tb, "node1"); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(tb.LogDir(), "node1-agent.log")); err == nil {
		u.logAt = int(fi.Size())
	}
	if err := StartAgent(context.Background(), tb, tb.Nodes[0]); err != nil {
		t.Fatal(err)
	}
}

// replaceUnderTraffic installs bin on node1 and restarts its agent under
// traffic (underTraffic).
func (u *upgrader) replaceUnderTraffic(t *testing.T, bin []byte, port int) {
	t.Helper()
	underTraffic(t, port, func() {
		u.replace(t, bin)
		u.restart(t)
	})
}

// underTraffic runs action while alice's TCP and UDP listeners on node1's
// port (see listenBoth) are hammered: bob's attempts (local and from node2)
// must all be refused, alice's all succeed.
func underTraffic(t *testing.T, port int, action func()) {
	t.Helper()
	n1 := tb.Nodes[0]
	ctx := context.Background()
	d := 5 * time.Second
	const noneOK = `(ERR=\d+|TIMEOUT=\d+|ERR=\d+ TIMEOUT=\d+)`
	probes := []struct {
		cmd  *exec.Cmd
		want string // regexp of the loop's outcome counts
	}{
		{loop(ctx, "node1", "bob", "tcp", "127.0.0.1", port, d), `ERR ECONNREFUSED=\d+`},
		{loop(ctx, "node2", "bob", "tcp", n1.Eth0V4.String(), port, d), `ERR ECONNREFUSED=\d+`},
		{loop(ctx, "node1", "bob", "udp", "127.0.0.1", port, d), noneOK},
		{loop(ctx, "node2", "bob", "udp", n1.Eth0V4.String(), port, d), noneOK},
		{loop(ctx, "node1", "alice", "tcp", "127.0.0.1", port, d), `OK echo=\d+`},
		{loop(ctx, "node2", "alice", "tcp", n1.IBV4.String(), port, d), `OK echo=\d+`},
		{loop(ctx, "node1", "alice", "udp", "::1", port, d), `OK=\d+`},
		{loop(ctx, "node2", "alice", "udp", n1.Eth0V4.String(), port, d), `OK=\d+`},
	}
	outs := make([]strings.Builder, len(probes))
	for i, p := range probes {
		p.cmd.Stdout = &outs[i]
		if err := p.cmd.Start(); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(500 * time.Millisecond) // traffic before the replacement
	action()
	for i, p := range probes {
		p.cmd.Wait()
		got := strings.TrimSpace(outs[i].String())
		if !regexp.MustCompile(`^` + p.want + `$`).MatchString(got) {
			t.Errorf("probe %v: outcomes %q, want only %s", p.cmd.Args[len(p.cmd.Args)-6:], got, p.want)
		}
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// clusterStatus runs `palisade status --all --json` on node1: the view and
// the exit status.
func clusterStatus(t *testing.T) (views map[string]control.NodeView, shared string, code int) {
	t.Helper()
	cmd := nodeCommand(context.Background(), tb, tb.Nodes[0], "status", "--all", "--json", "--timeout", "1s")
	out, err := cmd.Output()
	if err != nil {
		if _, ok := err.(*exec.ExitError); !ok {
			t.Fatalf("status --all: %v", err)
		}
		code = cmd.ProcessState.ExitCode()
	}
	var v struct {
		SharedSHA string             `json:"shared_sha256"`
		Nodes     []control.NodeView `json:"nodes"`
	}
	if err := json.Unmarshal(out, &v); err != nil {
		t.Fatalf("status --all (exit %d): %v: %s", code, err, out)
	}
	views = map[string]control.NodeView{}
	for _, n := range v.Nodes {
		views[n.Name] = n
	}
	if len(views) != len(tb.Nodes) {
		t.Errorf("status --all reports %d nodes, the testbed has %d", len(views), len(tb.Nodes))
	}
	return views, v.SharedSHA, code
}

// TestStatusAll: `palisade status --all` asks every node's agent over the
// ident service. All up and alike: every node enforcing with its running
// file's hash and generation. A node whose cluster-wide configuration
// differs (applied by reload) is "drift"; a node whose agent is stopped is
// "down" within the per-node timeout; either makes the exit status 2.
func TestStatusAll(t *testing.T) {
	needTestbed(t)
	views, shared, code := clusterStatus(t)
	for _, n := range tb.Nodes {
		v := views[n.Name]
		r := v.Report
		if v.State != control.NodeOK && v.State != control.NodeWarnings || r == nil {
			t.Fatalf("%s: %+v", n.Name, v)
		}
		st, err := control.ReadState(AgentPidFile(tb, n.Name))
		if err != nil {
			t.Fatal(err)
		}
		if r.Mode != "userwall" || !r.Enforcing || r.Version != st.Version || r.ConfigSHA != fileSHA(t, tb.ConfigPath(n.Name)) ||
			r.SharedSHA != shared || r.Generation != st.Generation || v.Addr != n.Eth0V4 {
			t.Errorf("%s: report %+v (state %+v, shared %s)", n.Name, r, st, shared)
		}
	}
	if code != 0 && code != 1 {
		t.Errorf("status --all with every node up and alike exits %d", code)
	}
	sharedMetric := func(node string) string {
		m, err := metrics(node, "127.0.0.1:9464")
		if err != nil {
			t.Fatalf("%s metrics: %v", node, err)
		}
		x := regexp.MustCompile(`palisade_config_shared_info\{shared_sha256="([0-9a-f]+)"\} 1`).FindStringSubmatch(m)
		if x == nil {
			t.Fatalf("%s metrics lack palisade_config_shared_info", node)
		}
		return x[1]
	}
	for _, n := range tb.Nodes {
		if got := sharedMetric(n.Name); got != shared {
			t.Errorf("%s: metric palisade_config_shared_info says %s, status --all %s", n.Name, got, shared)
		}
	}

	// As a user: one clear error (no node can be asked), not every node "down".
	cmd := tb.Command(context.Background(), "node1", "alice", tb.Binary, "status", "--all", "--config", tb.ConfigPath("node1"))
	out, _ := cmd.CombinedOutput()
	if cmd.ProcessState.ExitCode() != 2 || !strings.Contains(string(out), "needs root") || strings.Contains(string(out), "down") {
		t.Errorf("status --all as alice: exit %d\n%s", cmd.ProcessState.ExitCode(), out)
	}

	// Drift: node2 runs another [policy] (one more exempt listener).
	p := tb.ConfigPath("node2")
	orig := must(os.ReadFile(p))
	t.Cleanup(func() {
		os.WriteFile(p, orig, 0o644)
		reload(t, "node2")
	})
	conf := regexp.MustCompile(`(?m)^exempt_listeners = \[`).ReplaceAllString(string(orig), `exempt_listeners = ["daemon", `)
	if conf == string(orig) {
		t.Fatal("exempt_listeners not found in node2's configuration")
	}
	os.WriteFile(p, []byte(conf), 0o644)
	gen := reload(t, "node2").Generation
	views, _, code = clusterStatus(t)
	if v := views["node2"]; v.State != control.NodeDrift || v.Report == nil || v.Report.Generation != gen || !strings.Contains(v.Error, "expected") {
		t.Errorf("node2 with another policy: %+v", v)
	}
	if v := views["node1"]; v.State == control.NodeDrift || v.State == control.NodeDown {
		t.Errorf("node1: %+v", v)
	}
	if v := views["node2"]; v.Report != nil && sharedMetric("node2") != v.Report.SharedSHA {
		t.Errorf("node2's metric palisade_config_shared_info is not its drifted hash %s", v.Report.SharedSHA)
	}
	if code != 2 {
		t.Errorf("status --all with a drifting node exits %d, want 2", code)
	}
	os.WriteFile(p, orig, 0o644)
	reload(t, "node2")

	// Down: node2's agent stopped (its programs still enforce).
	n2 := tb.Nodes[1]
	pidFile := AgentPidFile(tb, n2.Name)
	pid := control.ReadPid(pidFile)
	if pid == 0 {
		t.Fatal("node2's agent not running")
	}
	t.Cleanup(func() {
		if err := StartAgent(context.Background(), tb, n2); err != nil {
			t.Error(err)
		}
	})
	if err := TermAgent(tb, n2.Name); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	views, _, code = clusterStatus(t)
	took := time.Since(start)
	if v := views["node2"]; v.State != control.NodeDown || v.Report != nil || !strings.Contains(v.Error, "no answer") {
		t.Errorf("node2 with its agent stopped: %+v", v)
	}
	if v := views["node1"]; v.State != control.NodeOK && v.State != control.NodeWarnings {
		t.Errorf("node1: %+v", v)
	}
	if code != 2 {
		t.Errorf("status --all with a node down exits %d, want 2", code)
	}
	if took > 10*time.Second {
		t.Errorf("status --all with a node down took %v (timeout 1 s per node)", took)
	}
}
