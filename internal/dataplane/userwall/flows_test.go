package userwall

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	"github.com/palisade-hpc/palisade/internal/identity"
)

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// refusal is a decoded cross-node refusal of connector cuid (0: none
// trusted) to listener luid's port.
func refusal(at time.Time, verdict string, cuid, luid uint32, port string) *Event {
	e := &Event{Time: at, Verdict: verdict, Rule: "default-deny", Path: "remote-tcp", Proto: "tcp", Stage: "socket",
		Src: "198.18.0.1:40000", Dst: "198.18.0.2:" + port, Listener: Party{UID: luid, User: "u" + port}}
	if verdict == "allow" {
		e.Rule = "same-user"
	}
	if cuid != 0 {
		e.Connector = &Party{UID: cuid}
	}
	return e
}

func record(r *flowRecorder, e *Event) { r.record(&pending{e: *e}) }

func u32(v uint32) *uint32 { return &v }

func TestFlowRing(t *testing.T) {
	r := newFlowRecorder(3, quietLog(), "node2", nil, nil)
	t0 := time.Date(2026, 11, 27, 18, 0, 0, 0, time.UTC)
	for i := range 5 {
		record(r, refusal(t0.Add(time.Duration(i)*time.Second), "deny", 2002, 2001, "5000"))
	}
	a := r.Flows(FlowQuery{}, 0)
	if len(a.Flows) != 3 || a.Flows[0].Seq != 3 || a.Flows[2].Seq != 5 || a.Next != 5 || !a.Oldest.Equal(t0.Add(2*time.Second)) {
		t.Fatalf("ring of 3 after 5: %+v", a)
	}
	if a := r.Flows(FlowQuery{After: 4}, 0); len(a.Flows) != 1 || a.Flows[0].Seq != 5 {
		t.Errorf("after cursor 4: %+v", a.Flows)
	}
	if a := r.Flows(FlowQuery{Limit: 2}, 0); len(a.Flows) != 2 || a.Flows[1].Seq != 5 || a.Omitted != 1 {
		t.Errorf("limit 2: newest two and 1 omitted, got %+v omitted %d", a.Flows, a.Omitted)
	}
	if a := r.Flows(FlowQuery{Filter: FlowFilter{Since: t0.Add(4 * time.Second)}}, 0); len(a.Flows) != 1 {
		t.Errorf("since: %d flows", len(a.Flows))
	}
	// A reload's flow_history: the newest are kept, in order.
	r.resize(2)
	record(r, refusal(t0.Add(6*time.Second), "deny", 2002, 2001, "5000"))
	if b := r.Flows(FlowQuery{}, 0); len(b.Flows) != 2 || b.Flows[0].Seq != 5 || b.Flows[1].Seq != 6 {
		t.Errorf("shrunk to 2: %+v", b.Flows)
	}
	r.resize(4)
	record(r, refusal(t0.Add(7*time.Second), "deny", 2002, 2001, "5000"))
	if b := r.Flows(FlowQuery{}, 0); len(b.Flows) != 3 || b.Flows[0].Seq != 5 || b.Flows[2].Seq != 7 {
		t.Errorf("grown to 4: %+v", b.Flows)
	}
	// The copy handed out is not the ring's.
	a.Flows[0].Connector.UID = 0
	if b := r.Flows(FlowQuery{}, 0); b.Flows[0].Connector.UID != 2002 {
		t.Error("an answer shares the ring's connector")
	}
}

func TestFlowFilter(t *testing.T) {
	r := newFlowRecorder(100, quietLog(), "node2", nil, nil)
	now := time.Now()
	record(r, refusal(now, "allow", 2001, 2001, "5000")) // alice → alice
	record(r, refusal(now, "deny", 2002, 2001, "5000"))  // bob → alice
	record(r, refusal(now, "deny", 2003, 2001, "6000"))  // carol → alice
	record(r, refusal(now, "audit", 0, 2002, "7000"))    // off-cluster → bob
	count := func(f FlowFilter) int { return len(r.Flows(FlowQuery{Filter: f}, 0).Flows) }
	for _, c := range []struct {
		name string
		f    FlowFilter
		want int
	}{
		{"all", FlowFilter{}, 4},
		{"as bob: his two", FlowFilter{AsUID: u32(2002)}, 2},
		{"as bob, user carol: none", FlowFilter{AsUID: u32(2002), User: u32(2003)}, 0},
		{"as alice", FlowFilter{AsUID: u32(2001)}, 3},
		{"listener alice", FlowFilter{ListenerUser: u32(2001)}, 3},
		{"connector bob", FlowFilter{ConnectorUser: u32(2002)}, 1},
		{"port 5000", FlowFilter{Port: 5000}, 2},
		{"deny", FlowFilter{Verdicts: []string{"deny"}}, 2},
		{"deny or audit", FlowFilter{Verdicts: []string{"deny", "audit"}}, 3},
		{"rule same-user", FlowFilter{Rule: "same-user"}, 1},
		{"proto udp", FlowFilter{Proto: "udp"}, 0},
	} {
		if got := count(c.f); got != c.want {
			t.Errorf("%s: %d flows, want %d", c.name, got, c.want)
		}
	}
	// A user sees the processes of their own ends only.
	r2 := newFlowRecorder(10, quietLog(), "node2", nil, nil)
	e := refusal(now, "deny", 2002, 2001, "5000")
	p := &pending{e: *e}
	r2.record(p)
	r2.mu.Lock()
	r2.ring[0].Listener.PID, r2.ring[0].Listener.Comm = 10, "jupyter"
	r2.ring[0].Connector.PID, r2.ring[0].Connector.Comm = 20, "curl"
	r2.mu.Unlock()
	for _, c := range []struct {
		as           *uint32
		lcomm, ccomm string
	}{{nil, "jupyter", "curl"}, {u32(2002), "", "curl"}, {u32(2001), "jupyter", ""}} {
		f := r2.Flows(FlowQuery{Filter: FlowFilter{AsUID: c.as}}, 0).Flows[0]
		if f.Listener.Comm != c.lcomm || f.Connector.Comm != c.ccomm || (c.lcomm == "") != (f.Listener.PID == 0) {
			t.Errorf("as %v: listener %q[%d], connector %q[%d]", c.as, f.Listener.Comm, f.Listener.PID, f.Connector.Comm, f.Connector.PID)
		}
	}
}

func TestAuditGroups(t *testing.T) {
	r := newFlowRecorder(10, quietLog(), "node1", nil, nil)
	t0 := time.Date(2026, 11, 27, 18, 0, 0, 0, time.UTC)
	for i := range 3 { // bob → alice:5000 in minutes 0, 1, 2
		record(r, refusal(t0.Add(time.Duration(i)*time.Minute), "audit", 2002, 2001, "5000"))
	}
	record(r, refusal(t0.Add(2*time.Minute), "audit", 2003, 2001, "5000")) // carol
	record(r, refusal(t0.Add(2*time.Minute), "allow", 2001, 2001, "5000")) // not a refusal
	a := r.Audit(AuditQuery{}, 0)
	if len(a.Groups) != 2 || a.Groups[0].Count != 3 || a.Groups[0].Connector.UID != 2002 ||
		!a.Groups[0].First.Equal(t0) || !a.Groups[0].Last.Equal(t0.Add(2*time.Minute)) || a.Groups[1].Count != 1 {
		t.Fatalf("groups: %+v", a.Groups)
	}
	// Minute granularity: since 1.5 min counts minutes 1 and 2.
	if a := r.Audit(AuditQuery{Filter: FlowFilter{Since: t0.Add(90 * time.Second)}}, 0); a.Groups[0].Count != 2 {
		t.Errorf("since minute 1: %+v", a.Groups)
	}
	if a := r.Audit(AuditQuery{Filter: FlowFilter{AsUID: u32(2003)}}, 0); len(a.Groups) != 1 || a.Groups[0].Connector.UID != 2003 {
		t.Errorf("as carol: %+v", a.Groups)
	}
	// Across nodes: the same group adds up, nodes listed once each.
	other := newFlowRecorder(10, quietLog(), "node2", nil, nil)
	record(other, refusal(t0.Add(5*time.Minute), "audit", 2002, 2001, "5000"))
	m := MergeAuditGroups([]AuditAnswer{r.Audit(AuditQuery{}, 0), other.Audit(AuditQuery{}, 0)})
	if len(m) != 2 || m[0].Count != 4 || !m[0].Last.Equal(t0.Add(5*time.Minute)) || len(m[0].Nodes) != 2 ||
		m[0].Nodes[0] != "node1" || m[0].Nodes[1] != "node2" {
		t.Errorf("merged: %+v", m)
	}
	// Bounded: the oldest minutes go first.
	r.maxGroups = 2
	record(r, refusal(t0.Add(3*time.Minute), "audit", 2004, 2001, "5000"))
	if a := r.Audit(AuditQuery{}, 0); !a.Covered.After(t0) || r.ngroups > 2 {
		t.Errorf("bounded to 2 groups: %d held, covered since %v", r.ngroups, a.Covered)
	}
}

func TestFlowAnswerFits(t *testing.T) {
	r := newFlowRecorder(1000, quietLog(), "node1", nil, nil)
	for range 200 {
		record(r, refusal(time.Now(), "deny", 2002, 2001, "5000"))
	}
	a := r.Flows(FlowQuery{Limit: 1000}, 4000)
	b, _ := json.Marshal(a)
	if len(b) > 4000 || len(a.Flows) == 0 || a.Omitted+len(a.Flows) != 200 || a.Flows[len(a.Flows)-1].Seq != 200 {
		t.Errorf("answer of %d bytes, %d flows, %d omitted (newest %d)", len(b), len(a.Flows), a.Omitted, a.Flows[len(a.Flows)-1].Seq)
	}
}

// The sink hands verdicts over without waiting: a recorder that is behind
// loses them, counted.
func TestFlowOfferNeverBlocks(t *testing.T) {
	r := newFlowRecorder(10, quietLog(), "node1", nil, nil)
	r.in = make(chan *pending, 2) // nobody reads
	for range 5 {
		r.offer(refusal(time.Now(), "deny", 2002, 2001, "5000"), 0)
	}
	if r.Dropped.Load() != 3 {
		t.Errorf("dropped %d, want 3", r.Dropped.Load())
	}
}

// blockingNames answers uid lookups only when released.
type blockingNames struct {
	identity.Resolver
	asked, release chan struct{}
}

func (b blockingNames) LookupUID(uid uint32) (string, error) {
	b.asked <- struct{}{}
	<-b.release
	return "alice", nil
}

func (b blockingNames) LookupGID(gid uint32) (string, error) { return "", errors.New("none") }

// TestSinkReopenDuringLookup: a reload's reopen of the event log returns
// while the sink is stuck in a name lookup (a slow directory); the line is
// then written to the new log.
func TestSinkReopenDuringLookup(t *testing.T) {
	dir := t.TempDir()
	s, err := newEventSink(filepath.Join(dir, "a.jsonl"), false, 100, quietLog())
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	names := blockingNames{asked: make(chan struct{}), release: make(chan struct{})}
	s.names = identity.NewNameCache(names, time.Minute)
	r := kernel.RawEvent{Cuid: 2002, Luid: 2001, Proto: 6, Family: 4, Rule: 8, Path: 2, HasConnector: 1, Dport: 5000}
	var buf bytes.Buffer
	binary.Write(&buf, binary.NativeEndian, &r)
	done := make(chan struct{})
	go func() { s.handle(buf.Bytes()); close(done) }()
	<-names.asked // the sink waits for the directory now
	if err := s.reopen(filepath.Join(dir, "b.jsonl"), false, 100); err != nil {
		t.Fatal(err)
	}
	close(names.release)
	for range 3 { // the connector's and the listener's names (cached after)
		select {
		case <-names.asked:
		case <-done:
		}
	}
	<-done
	b, _ := os.ReadFile(filepath.Join(dir, "b.jsonl"))
	if !bytes.Contains(b, []byte(`:5000"`)) {
		t.Errorf("new log: %q", b)
	}
	if a, _ := os.ReadFile(filepath.Join(dir, "a.jsonl")); len(a) != 0 {
		t.Errorf("old log written after the reopen: %q", a)
	}
}

// TestSinkWriteErrorCounted: a line the log does not take is counted.
func TestSinkWriteErrorCounted(t *testing.T) {
	s, err := newEventSink(filepath.Join(t.TempDir(), "e.jsonl"), false, 100, quietLog())
	if err != nil {
		t.Fatal(err)
	}
	s.out.Load().file.Close() // writes now fail
	s.write([]byte(`{}`))
	s.write([]byte(`{}`))
	if n := s.WriteErrors.Load(); n != 2 {
		t.Errorf("write errors %d, want 2", n)
	}
}
