package check

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/palisade-hpc/palisade/lab/probe"
)

// Report is the outcome of a run: every case with its expectation and
// observation.
type Report struct {
	Mode     string
	Testbed  string
	Nodes    int
	Cases    []*Case
	Warnings []string
	Elapsed  time.Duration
	// MaxMismatches bounds the mismatches WriteTable lists (0 = all).
	MaxMismatches int `json:"-"`
}

// Counts returns how many cases passed and failed.
func (r *Report) Counts() (passed, failed int) {
	for _, c := range r.Cases {
		if c.Passed() {
			passed++
		} else {
			failed++
		}
	}
	return
}

// Failures are the cases whose observation differs from the expectation.
func (r *Report) Failures() []*Case {
	var out []*Case
	for _, c := range r.Cases {
		if !c.Passed() {
			out = append(out, c)
		}
	}
	return out
}

var protoFams = []string{"tcp4", "tcp6", "udp4", "udp6"}

type cell struct{ cases, allowed, failed int }

// WriteTable prints one row per launcher × path with, per protocol and
// family, "allowed/cases" (a mismatch count follows as "!n"), then every
// mismatch in full, and a final "N passed, M failed" line.
func (r *Report) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "palisade-lab check: mode %s, testbed %s (%d nodes), %d cases in %v\n\n",
		r.Mode, r.Testbed, r.Nodes, len(r.Cases), r.Elapsed.Round(10*time.Millisecond))
	type key struct {
		l  Launcher
		p  Path
		pf string
	}
	cells := map[key]*cell{}
	for _, c := range r.Cases {
		k := key{c.Launcher, c.Path, c.ProtoFamily()}
		if cells[k] == nil {
			cells[k] = &cell{}
		}
		x := cells[k]
		x.cases++
		if c.Observed.State == Allowed {
			x.allowed++
		}
		if !c.Passed() {
			x.failed++
		}
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "LAUNCHER\tPATH\tTCP4\tTCP6\tUDP4\tUDP6\tRESULT\t")
	for _, l := range Launchers {
		for _, p := range append(Paths[:len(Paths):len(Paths)], Unix) {
			row := []string{string(l), string(p)}
			total, failed := 0, 0
			pfs := protoFams
			if p == Unix {
				// Abstract Unix sockets: stream under TCP, datagram under UDP.
				pfs = []string{"unix-stream", "", "unix-dgram", ""}
			}
			for _, pf := range pfs {
				x := cells[key{l, p, pf}]
				if x == nil {
					row = append(row, "-")
					continue
				}
				s := fmt.Sprintf("%d/%d", x.allowed, x.cases)
				if x.failed > 0 {
					s += fmt.Sprintf(" !%d", x.failed)
				}
				row = append(row, s)
				total += x.cases
				failed += x.failed
			}
			if total == 0 {
				continue
			}
			res := "ok"
			if failed > 0 {
				res = fmt.Sprintf("%d FAILED", failed)
			}
			fmt.Fprintln(tw, strings.Join(append(row, res), "\t")+"\t")
		}
	}
	tw.Flush()
	fmt.Fprintln(w, "\ncells: allowed/cases (data exchanged both ways with the expected listener); !n = n mismatches")

	r.writeRules(w)
	for _, s := range r.Warnings {
		fmt.Fprintf(w, "warning: %s\n", s)
	}
	fails := r.Failures()
	if len(fails) > 0 {
		fmt.Fprintf(w, "\nMISMATCHES (%d):\n", len(fails))
		shown := fails
		if r.MaxMismatches > 0 && len(shown) > r.MaxMismatches {
			shown = shown[:r.MaxMismatches]
		}
		for _, c := range shown {
			fmt.Fprintf(w, "  %s\n", describeFailure(c))
		}
		if len(shown) < len(fails) {
			fmt.Fprintf(w, "  … and %d more (--json lists every case)\n", len(fails)-len(shown))
		}
	}
	passed, failed := r.Counts()
	fmt.Fprintf(w, "\n%d passed, %d failed\n", passed, failed)
}

// writeRules summarises expectations by rule: with a policy mode it shows
// which rules the matrix exercised.
func (r *Report) writeRules(w io.Writer) {
	type agg struct{ allow, deny int }
	rules := map[string]*agg{}
	var names []string
	for _, c := range r.Cases {
		a := rules[c.Expected.Rule]
		if a == nil {
			a = &agg{}
			rules[c.Expected.Rule] = a
			names = append(names, c.Expected.Rule)
		}
		if c.Expected.Allow {
			a.allow++
		} else {
			a.deny++
		}
	}
	slices.Sort(names)
	var parts []string
	for _, n := range names {
		a := rules[n]
		switch {
		case a.deny == 0:
			parts = append(parts, fmt.Sprintf("%s %d allow", n, a.allow))
		case a.allow == 0:
			parts = append(parts, fmt.Sprintf("%s %d deny", n, a.deny))
		default:
			parts = append(parts, fmt.Sprintf("%s %d allow/%d deny", n, a.allow, a.deny))
		}
	}
	fmt.Fprintf(w, "expected by rule: %s\n", strings.Join(parts, ", "))
}

func verdictWord(allow bool) string {
	if allow {
		return "allow"
	}
	return "deny"
}

func describeFailure(c *Case) string {
	obs := c.Observed.State
	if c.Observed.Kind != "" {
		obs += " " + c.Observed.Kind
	}
	if c.Observed.Peer != nil && c.Observed.State == Allowed {
		obs += " by " + c.Observed.Peer.String()
	}
	s := fmt.Sprintf("%s %s %s@%s → %s@%s %s %s %s: expected %s (%s), observed %s", c.ID, c.Launcher,
		c.Connector.Name, c.Connector.Node, c.Listener.Name, c.Listener.Node, c.ProtoFamily(), c.Path,
		c.Target(), verdictWord(c.Expected.Allow), c.Expected.Rule, obs)
	if c.Observed.Error != "" {
		s += " — " + c.Observed.Error
	}
	if c.Expected.Audit && c.AuditEvent != AuditLogged {
		s += " — no audit event in " + c.Listener.Node + "'s event log"
	}
	return s
}

// CaseRecord is the --json form of a case.
type CaseRecord struct {
	ID            string          `json:"id"`
	Launcher      Launcher        `json:"launcher"`
	Path          Path            `json:"path"`
	Proto         string          `json:"proto"`
	Family        int             `json:"family"`
	Connector     string          `json:"connector"`
	ConnectorNode string          `json:"connector_node"`
	Listener      string          `json:"listener"`
	ListenerNode  string          `json:"listener_node"`
	Dst           string          `json:"dst"`
	Src           string          `json:"src,omitempty"`
	Expected      string          `json:"expected"` // allow, deny
	Rule          string          `json:"rule"`
	Observed      string          `json:"observed"` // allowed, refused, error
	Kind          string          `json:"kind,omitempty"`
	Error         string          `json:"error,omitempty"`
	Peer          *probe.Identity `json:"peer,omitempty"`
	Micros        int64           `json:"us,omitempty"`
	Pass          bool            `json:"pass"`
	// AuditEvent: check --mode audit's finding for a case the policy
	// refuses ("logged" or "missing").
	AuditEvent string `json:"audit_event,omitempty"`
}

// String is the case on one line, as the VM tests log a mismatch.
func (c CaseRecord) String() string {
	return fmt.Sprintf("%s %s %s→%s %s%d %s: expected %s (%s), observed %s %s %s", c.ID, c.Launcher, c.Connector, c.Listener,
		c.Proto, c.Family, c.Path, c.Expected, c.Rule, c.Observed, c.Kind, c.Error)
}

// JSONReport is the document WriteJSON prints (`check --json`), as a reader
// decodes it.
type JSONReport struct {
	Mode      string       `json:"mode"`
	Testbed   string       `json:"testbed"`
	Nodes     int          `json:"nodes"`
	Passed    int          `json:"passed"`
	Failed    int          `json:"failed"`
	ElapsedMS int64        `json:"elapsed_ms"`
	Warnings  []string     `json:"warnings"`
	Cases     []CaseRecord `json:"cases"`
}

// ParseJSON reads WriteJSON's document.
func ParseJSON(b []byte) (*JSONReport, error) {
	var r JSONReport
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// Record flattens a case for machines.
func (c *Case) Record() CaseRecord {
	rec := CaseRecord{ID: c.ID, Launcher: c.Launcher, Path: c.Path, Proto: c.Proto.String(), Family: c.Family,
		Connector: c.Connector.Name, ConnectorNode: c.Connector.Node, Listener: c.Listener.Name,
		ListenerNode: c.Listener.Node, Dst: c.Target(), Expected: verdictWord(c.Expected.Allow),
		Rule: c.Expected.Rule, Observed: c.Observed.State, Kind: c.Observed.Kind, Error: c.Observed.Error,
		Peer: c.Observed.Peer, Micros: c.Observed.Micros, Pass: c.Passed(), AuditEvent: c.AuditEvent}
	if c.Src.IsValid() {
		rec.Src = c.Src.String()
	}
	return rec
}

// WriteJSON prints the whole report as one JSON document, one case per line.
func (r *Report) WriteJSON(w io.Writer) error {
	passed, failed := r.Counts()
	warnings := r.Warnings
	if warnings == nil {
		warnings = []string{}
	}
	head, _ := json.Marshal(map[string]any{"mode": r.Mode, "testbed": r.Testbed, "nodes": r.Nodes,
		"passed": passed, "failed": failed, "elapsed_ms": r.Elapsed.Milliseconds(), "warnings": warnings})
	// Splice the cases in so that each sits on its own line.
	if _, err := fmt.Fprintf(w, "%s,\n\"cases\":[\n", head[:len(head)-1]); err != nil {
		return err
	}
	for i, c := range r.Cases {
		b, _ := json.Marshal(c.Record())
		sep := ",\n"
		if i == len(r.Cases)-1 {
			sep = "\n"
		}
		if _, err := fmt.Fprintf(w, "%s%s", b, sep); err != nil {
			return err
		}
	}
	_, err := fmt.Fprintln(w, "]}")
	return err
}
