package testbed

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// DaemonStatus is one daemon of the instance.
type DaemonStatus struct {
	Node  string // "" for munged (host namespace)
	Name  string
	PID   int
	Alive bool
}

// Daemons reports the instance's daemons from their pid files.
func (tb *Testbed) Daemons() []DaemonStatus {
	check := func(node, name, pidfile string) DaemonStatus {
		d := DaemonStatus{Node: node, Name: name}
		if b, err := os.ReadFile(pidfile); err == nil {
			d.PID, _ = strconv.Atoi(strings.TrimSpace(string(b)))
			d.Alive = d.PID > 1 && procfs.Alive(d.PID)
		}
		return d
	}
	out := []DaemonStatus{check("", "munged", filepath.Join(tb.Dir, "munge", "run", "munged.pid"))}
	for i, n := range tb.Nodes {
		if i == 0 {
			out = append(out, check(n.Name, "slurmctld", filepath.Join(tb.RunDir(), "slurmctld.pid")))
		}
		out = append(out, check(n.Name, "slurmd", filepath.Join(tb.RunDir(), "slurmd-"+n.Name+".pid")))
		out = append(out, check(n.Name, "sshd", filepath.Join(tb.RunDir(), "sshd-"+n.Name+".pid")))
	}
	return out
}

// Sinfo returns `sinfo -N` node states (node -> state), run on node1.
func (tb *Testbed) Sinfo(ctx context.Context) (map[string]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	out, err := tb.Output(ctx, tb.Nodes[0].Name, "", "sinfo", "-h", "-N", "-o", "%N %t")
	if err != nil {
		return nil, err
	}
	m := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) == 2 {
			m[f[0]] = f[1]
		}
	}
	return m, nil
}

// Status renders a human-readable report.
func (tb *Testbed) Status(ctx context.Context) string {
	var b strings.Builder
	fmt.Fprintf(&b, "testbed %s: up, %d nodes, mode %s", tb.Name, len(tb.Nodes), tb.Mode)
	if len(tb.Extensions) > 0 {
		fmt.Fprintf(&b, ", extensions %s", strings.Join(tb.Extensions, ","))
	}
	if tb.VM {
		b.WriteString(", in a VM")
		if tb.Kernel != "" {
			b.WriteString(" (kernel " + tb.Kernel + ")")
		}
	}
	fmt.Fprintf(&b, "\ndir %s  binary %s\n", tb.Dir, tb.Binary)
	sinfo, serr := tb.Sinfo(ctx)
	var daemons []DaemonStatus
	if !tb.VM { // a VM's daemons are not visible from the host
		daemons = tb.Daemons()
	}
	fmt.Fprintf(&b, "%-8s %-12s %-15s %-16s %-15s %-18s %-8s %s\n", "NODE", "NETNS", "ETH0", "ETH0 v6", "IB0", "IB0 v6", "SLURM", "DAEMONS")
	for _, n := range tb.Nodes {
		var ds []string
		for _, d := range daemons {
			if d.Node == n.Name {
				s := d.Name
				if !d.Alive {
					s += "(DEAD)"
				}
				ds = append(ds, s)
			}
		}
		st := sinfo[n.Name]
		if st == "" {
			st = "?"
		}
		fmt.Fprintf(&b, "%-8s %-12s %-15s %-16s %-15s %-18s %-8s %s\n", n.Name, n.NetNS, n.Eth0V4, n.Eth0V6, n.IBV4, n.IBV6, st, strings.Join(ds, " "))
	}
	fmt.Fprintf(&b, "%-8s %-12s %-15s %-16s (router %s: %s %s / %s %s)\n", "outside", tb.Outside.NetNS, tb.Outside.Eth0V4, tb.Outside.Eth0V6,
		tb.Router, RouterEth0V4, RouterEth0V6, RouterOutsideV4, RouterOutsideV6)
	if len(daemons) > 0 {
		m := daemons[0]
		fmt.Fprintf(&b, "munged pid %d alive=%v  socket %s\n", m.PID, m.Alive, tb.MungeSocket())
	}
	if serr != nil {
		fmt.Fprintf(&b, "sinfo failed: %v\n", serr)
	}
	return b.String()
}
