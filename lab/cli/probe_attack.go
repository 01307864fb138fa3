package cli

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/palisade-hpc/palisade/lab/check/attack"
	"github.com/palisade-hpc/palisade/lab/check/fuzz"
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
			// The starter holds our stdin: its first line opens a gated
			// sink's gate; when it closes stdin, we are done.
			gate := make(chan struct{})
			go func() {
				rd := bufio.NewReader(os.Stdin)
				if s.Gated {
					if _, err := rd.ReadString('\n'); err != nil {
						os.Exit(0)
					}
					close(gate)
				}
				io.Copy(io.Discard, rd)
				os.Exit(0)
			}()
			return attack.ServeGated(s, cmd.OutOrStdout(), gate)
		},
	}
	c.Flags().StringVar(&spec, "spec", "", "socket description (JSON)")
	return c
}

func probeActCmd() *cobra.Command {
	var spec string
	var serve bool
	c := &cobra.Command{
		Use:   "act --spec JSON | --serve",
		Short: "Run one attack-suite step (send a nonce as described) and print the result as JSON",
		Long: "Run one attack-suite step (send a nonce as described) and print the result as JSON.\n" +
			"--serve runs a step per line of stdin (a spec each) and prints a result line per step, until stdin closes.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if serve {
				return attack.ServeActs(os.Stdin, cmd.OutOrStdout())
			}
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
	c.Flags().BoolVar(&serve, "serve", false, "run a step per stdin line until stdin closes")
	return c
}

// `palisade-lab probe sentinel` and `palisade-lab probe fuzz`: the attack
// fuzzer's victim sockets and one program run (check --fuzz).
func probeSentinelCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "sentinel",
		Short: "Bind the sockets described on stdin's first line (JSON list) and report every byte they receive",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			in := bufio.NewReader(os.Stdin)
			line, err := in.ReadBytes('\n')
			if err != nil {
				return err
			}
			var specs []attack.SinkSpec
			if err := json.Unmarshal(line, &specs); err != nil {
				return fmt.Errorf("bad specs: %w", err)
			}
			// The starter holds our stdin: when it closes it, we are done.
			go func() { io.Copy(io.Discard, in); os.Exit(0) }()
			return attack.ServeAll(specs, cmd.OutOrStdout())
		},
	}
}

func probeFuzzCmd() *cobra.Command {
	var prog, prefix string
	var peer bool
	var wait time.Duration
	c := &cobra.Command{
		Use:   "fuzz --prog BASE64 --prefix HEX [--peer]",
		Short: "Run one fuzzer program (or, with --peer, its fd-passing peer) and print what each call returned",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			b, err := base64.RawURLEncoding.DecodeString(prog)
			if err != nil {
				return fmt.Errorf("bad --prog: %w", err)
			}
			var p fuzz.Program
			if err := json.Unmarshal(b, &p); err != nil {
				return fmt.Errorf("bad --prog: %w", err)
			}
			if wait > 0 {
				fuzz.ConnectWait = wait
			}
			if peer {
				fuzz.ExecPeer(p.PeerSteps, prefix, cmd.OutOrStdout())
				return nil
			}
			fuzz.Exec(p.Steps, prefix, p.Peer != "", cmd.OutOrStdout())
			return nil
		},
	}
	c.Flags().StringVar(&prog, "prog", "", "the program (JSON, base64url)")
	c.Flags().StringVar(&prefix, "prefix", "", "nonce prefix of this run (hex)")
	c.Flags().BoolVar(&peer, "peer", false, "be the peer that receives the program's passed sockets")
	c.Flags().DurationVar(&wait, "wait", 0, "bound on a connect (default 700ms)")
	return c
}
