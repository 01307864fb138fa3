package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/palisade-hpc/palisade/lab/check/attack"
	"github.com/spf13/cobra"
)

// `palisade-lab probe sink` and `palisade-lab probe act`: the victim socket and one
// attacker (or control) step of the attack suite (check --attacks).
func probeSinkCmd() *cobra.Command {
	var spec string
	c := &cobra.Command{
		Use:   "sink --spec JSON",
		Short: "Bind one socket as described and print every nonce it receives (attack suite victim)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var s attack.SinkSpec
			if err := json.Unmarshal([]byte(spec), &s); err != nil {
				return fmt.Errorf("bad --spec: %w", err)
			}
			// The starter holds our stdin: when it closes it, we are done.
			go func() { io.Copy(io.Discard, os.Stdin); os.Exit(0) }()
			return attack.Serve(s, cmd.OutOrStdout())
		},
	}
	c.Flags().StringVar(&spec, "spec", "", "socket description (JSON)")
	return c
}

func probeActCmd() *cobra.Command {
	var spec string
	c := &cobra.Command{
		Use:   "act --spec JSON",
		Short: "Run one attack-suite step (send a nonce as described) and print the result as JSON",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var s attack.ActSpec
			if err := json.Unmarshal([]byte(spec), &s); err != nil {
				return fmt.Errorf("bad --spec: %w", err)
			}
			if s.LoopMS > 0 {
				attack.Loop(s, cmd.OutOrStdout())
				return nil
			}
			return json.NewEncoder(cmd.OutOrStdout()).Encode(attack.Act(s))
		},
	}
	c.Flags().StringVar(&spec, "spec", "", "step description (JSON)")
	return c
}
