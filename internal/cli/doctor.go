package cli

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
)

// writeProbe prints the kernel feature table (status and doctor).
func writeProbe(out io.Writer, p *kernel.Probe) {
	fmt.Fprintf(out, "kernel %s (userwall needs >= %s):\n", p.Kernel, p.Floor)
	tw := tabwriter.NewWriter(out, 2, 8, 2, ' ', 0)
	fmt.Fprintf(tw, "  FEATURE\tPRESENT\tSINCE\tNEEDED BY\tWITHOUT IT\n")
	for _, f := range p.Features {
		present := "yes"
		if !f.Present {
			present = "NO"
		}
		without := "agent refuses to start"
		if !f.Required {
			without = f.Fallback
		}
		if f.Present {
			without = ""
		}
		needs := strings.Join(f.Needs, ", ")
		if len(needs) > 60 {
			needs = needs[:57] + "..."
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\n", f.Name, present, f.Since, needs, without)
	}
	tw.Flush()
	for _, f := range p.Features {
		if !f.Present && f.Detail != "" {
			fmt.Fprintf(out, "  %s: %s\n", f.Name, f.Detail)
		}
	}
}

// doctorCommand runs the agent's feature probe before installation.
func doctorCommand() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "Check this node's kernel for every feature the userwall agent needs (changes nothing)",
		Long: `Runs the agent's own start-up probe: program and map types, every helper and
kfunc the compiled programs call, BTF, SO_NETNS_COOKIE, cgroup v2, tcx links or
clsact + cls_bpf, and the bpf LSM. Prints the table and exits 1 if the agent
would refuse to start. Nothing is installed or left behind (probe programs are
unloaded, the clsact probe runs in a throw-away network namespace).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			p, err := kernel.ProbeKernel()
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON {
				if err := writeJSON(out, p); err != nil {
					return err
				}
			} else {
				writeProbe(out, p)
			}
			if err := p.Err(); err != nil {
				return &ExitError{Code: 1, Msg: err.Error()}
			}
			if !asJSON {
				fmt.Fprintln(out, "\nuserwall can run on this kernel.")
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
