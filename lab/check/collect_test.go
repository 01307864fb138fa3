package check

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/palisade-hpc/palisade/lab/probe"
)

// writeLines writes connector output as `probe connect --out` would.
func writeLines(t *testing.T, path string, lines ...probe.Line) {
	t.Helper()
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	for _, l := range lines {
		enc.Encode(l)
	}
	if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestCollect feeds the result reader every way a run can go wrong and
// checks that each case is observed as it must be: never silently passed.
func TestCollect(t *testing.T) {
	tb, res := fixture(t)
	m, err := buildMatrix(tb, res, []Launcher{Plain, Srun, Sbatch, MPIRun}, true)
	if err != nil {
		t.Fatal(err)
	}
	r := &runner{tb: tb, m: m, dir: t.TempDir(), dead: map[string]string{}}
	os.Mkdir(r.outDir(), 0o755)
	procOf := func(l Launcher, user string) *proc {
		for _, p := range m.procs {
			if p.Launcher == l && p.User == user && !strings.HasPrefix(p.tag, "outside") {
				return p
			}
		}
		t.Fatalf("no proc %s %s", l, user)
		return nil
	}
	start := func(p *proc, host string, launch map[string]string) probe.Line {
		return probe.Line{Type: "start", Host: host, Self: &probe.Creds{UID: p.Connector.UID, GID: p.Connector.GID, Launch: launch}}
	}
	answer := func(c *Case) probe.Line {
		return probe.Line{Type: "result", Host: c.Connector.Node, ID: c.ID, Allowed: true,
			Peer: &probe.Identity{UID: c.Listener.UID, GID: c.Listener.GID, Host: c.Listener.Node}}
	}
	out := func(p *proc, host string) string { return filepath.Join(r.outDir(), p.tag+"-"+host+".jsonl") }

	// 1. plain bob: all answered, but one by the wrong listener and one
	// refused.
	pb := procOf(Plain, "bob")
	lines := []probe.Line{start(pb, "node1", nil)}
	for i, c := range pb.Cases {
		l := answer(c)
		switch i {
		case 0:
			l.Peer.UID = 9999
		case 1:
			l = probe.Line{Type: "result", Host: "node1", ID: c.ID, Kind: "ECONNREFUSED"}
		}
		lines = append(lines, l)
	}
	writeLines(t, out(pb, "node1"), append(lines, probe.Line{Type: "done", Host: "node1"})...)
	pb.output = "some launcher noise\n{\"type\":\"done\",\"host\":\"node1\",\"cases\":100}\n"
	r.collect(pb)
	if s := pb.Cases[0].Observed.State; s != Broken {
		t.Errorf("wrong listener answered: observed %s", s)
	}
	if o := pb.Cases[1].Observed; o.State != Refused || o.Kind != "ECONNREFUSED" {
		t.Errorf("refusal: observed %+v", o)
	}
	if o := pb.Cases[2].Observed; o.State != Allowed {
		t.Errorf("answer: observed %+v", o)
	}

	// 2. srun carol: srun failed as a whole — every case fails, with why.
	pc := procOf(Srun, "carol")
	pc.failure = "srun as carol on node1: exit status 1 srun: error: Unable to allocate resources"
	r.collect(pc)
	for _, c := range pc.Cases {
		if c.Observed.State != Broken || !strings.Contains(c.Observed.Error, "Unable to allocate") {
			t.Fatalf("%s: observed %+v", c, c.Observed)
		}
	}

	// 3. sbatch root: ran in another job than the one submitted.
	pr := procOf(Sbatch, "root")
	pr.jobID = "42"
	h := pr.Hosts[0]
	lines = []probe.Line{start(pr, h, map[string]string{"SLURM_JOB_ID": "41"})}
	for _, c := range pr.Cases {
		lines = append(lines, answer(c))
	}
	writeLines(t, out(pr, h), append(lines, probe.Line{Type: "done", Host: h})...)
	r.collect(pr)
	if o := pr.Cases[0].Observed; o.State != Broken || !strings.Contains(o.Error, "batch job 42") {
		t.Errorf("wrong job: observed %+v", o)
	}

	// 4. mpirun bob: only rank 0 reported; rank 1's cases fail, rank 0's
	// pass; a rank that stopped half-way fails its missing cases.
	pm := procOf(MPIRun, "bob")
	lines = []probe.Line{start(pm, "node1", map[string]string{"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})}
	n := 0
	for _, c := range pm.Cases {
		if c.Connector.Node == "node1" && n < 10 {
			lines = append(lines, answer(c))
			n++
		}
	}
	writeLines(t, out(pm, "node1"), lines...) // no "done": the rank died
	r.collect(pm)
	var ok, broken int
	for _, c := range pm.Cases {
		switch c.Observed.State {
		case Allowed:
			ok++
		case Broken:
			broken++
		default:
			t.Errorf("%s: observed %+v", c, c.Observed)
		}
	}
	if ok != 10 || broken != len(pm.Cases)-10 {
		t.Errorf("mpirun: %d allowed, %d broken of %d", ok, broken, len(pm.Cases))
	}

	// 5. A listener that never started turns a refusal into an error.
	pp := procOf(Plain, "carol")
	target := pp.Cases[0]
	r.dead[target.Listener.Node+"/"+target.Listener.Name] = "bind: address already in use"
	lines = []probe.Line{start(pp, "node1", nil)}
	for _, c := range pp.Cases {
		lines = append(lines, probe.Line{Type: "result", Host: "node1", ID: c.ID, Kind: "ECONNREFUSED"})
	}
	writeLines(t, out(pp, "node1"), append(lines, probe.Line{Type: "done", Host: "node1"})...)
	pp.output = `{"type":"done","host":"node1"}` + "\n"
	r.collect(pp)
	if o := target.Observed; o.State != Broken || !strings.Contains(o.Error, "did not start") {
		t.Errorf("dead listener: observed %+v", o)
	}

	// 6. srun root: every result arrived through the shared directory, but
	// srun never delivered the connector's stdout (srun exits 0 anyway).
	ps := procOf(Srun, "root")
	h = ps.Hosts[0]
	lines = []probe.Line{start(ps, h, map[string]string{"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"})}
	for _, c := range ps.Cases {
		lines = append(lines, answer(c))
	}
	writeLines(t, out(ps, h), append(lines, probe.Line{Type: "done", Host: h})...)
	ps.output = "srun: error: slurmstepd could not connect IO\n"
	r.collect(ps)
	for _, c := range ps.Cases {
		if o := c.Observed; o.State != Broken || !strings.Contains(o.Error, "lost the output") {
			t.Fatalf("lost I/O: %s observed %+v", c, o)
		}
	}
	ps.output += fmt.Sprintf(`{"type":"done","host":%q}`+"\n", h)
	r.collect(ps)
	if o := ps.Cases[0].Observed; o.State != Allowed {
		t.Errorf("with its output delivered: observed %+v", o)
	}

	// The report lists every failure and ends with the count line.
	for _, c := range m.cases {
		c.Expected = ExpectOpen(c)
	}
	rep := &Report{Mode: "none", Testbed: "fixture", Nodes: 3, Cases: m.cases}
	var tab bytes.Buffer
	rep.WriteTable(&tab)
	passed, failed := rep.Counts()
	if failed == 0 || !strings.HasSuffix(tab.String(), fmt.Sprintf("\n%d passed, %d failed\n", passed, failed)) {
		t.Errorf("table does not end with the count line:\n%s", tab.String())
	}
	if got := strings.Count(tab.String(), "\n  c"); got != failed {
		t.Errorf("%d mismatch lines for %d failures", got, failed)
	}
	var js bytes.Buffer
	if err := rep.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	doc, err := ParseJSON(js.Bytes())
	if err != nil {
		t.Fatalf("--json output does not parse: %v", err)
	}
	if doc.Passed != passed || doc.Failed != failed || len(doc.Cases) != len(m.cases) || doc.Mode != rep.Mode || doc.Nodes != rep.Nodes {
		t.Errorf("json: %d/%d/%d", doc.Passed, doc.Failed, len(doc.Cases))
	}
}
