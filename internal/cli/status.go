package cli

import (
	"encoding/json"
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall"
)

func statusCommand() *cobra.Command {
	var (
		asJSON  bool
		pidFile string
	)
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the data plane of this node: mode, programs attached, counters, warnings",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			s, err := userwall.GetStatus(userwall.AgentOptions{ConfigPath: configPath, PidFile: pidFile})
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON {
				e := json.NewEncoder(out)
				e.SetIndent("", "  ")
				return e.Encode(s)
			}
			fmt.Fprintf(out, "mode:        %s\n", s.Mode)
			if s.Mode == "none" {
				fmt.Fprintf(out, "no userwall programs pinned in %s (netns cookie %d)\n", s.PinDir, s.NetnsCookie)
				return nil
			}
			agent := "not running"
			if s.AgentPID != 0 {
				agent = fmt.Sprintf("running (pid %d)", s.AgentPID)
			}
			fmt.Fprintf(out, "agent:       %s\nenforcing:   %v\npins:        %s\nnft table:   %v\nunix (LSM):  %v\n",
				agent, s.Enabled, s.PinDir, s.Nft, s.UnixLSM)
			fmt.Fprintf(out, "\nprograms attached (%d):\n", len(s.Links))
			tw := tabwriter.NewWriter(out, 2, 8, 2, ' ', 0)
			for _, l := range s.Links {
				fmt.Fprintf(tw, "  %s\t%s\t%s\tprog %d\n", l.Name, l.Type, l.Program, l.ProgID)
			}
			tw.Flush()
			fmt.Fprintln(out, "\ndecisions:")
			tw = tabwriter.NewWriter(out, 2, 8, 2, ' ', 0)
			for _, c := range s.Counters {
				v := "deny"
				if c.Allowed {
					v = "allow"
				}
				fmt.Fprintf(tw, "  %s\t%s\t%s\t%d\n", c.Path, c.Rule, v, c.Count)
			}
			tw.Flush()
			for _, w := range s.Warnings {
				fmt.Fprintf(out, "\nWARNING: %s\n", w)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.Flags().StringVar(&pidFile, "pid-file", "", "agent pid file (default: [agent] pid_file)")
	return cmd
}
