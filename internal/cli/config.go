package cli

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall"
	"github.com/palisade-hpc/palisade/internal/identity"
)

func configCommand() *cobra.Command {
	configCmd := &cobra.Command{
		Use:   "config",
		Short: "Inspect Palisade's configuration",
	}
	var (
		slurmConf string
		strict    bool
		remote    bool
	)
	check := &cobra.Command{
		Use:   "check",
		Short: "Validate the configuration file, print the effective policy and warn about risky settings",
		Long: `Validate --config (unknown keys, subnets, users, ports, ranges, duplicates) and print
the effective policy with every default filled in, the file's SHA-256 (the
configuration hash that status and the metric palisade_config_info show for
the running agent) and a WARNING for each risky setting (system_port_max above
1023, empty exemption lists or cluster subnets, a public metrics address, no
event log, ...). The policy's [[test]] entries are run (palisade policy test):
a failing test is an ERROR. Slurm's accounts (SlurmUser, SlurmdUser in --slurm-conf) must
be exempt connectors and listeners, or srun and sinfo fail with "Unable to
contact slurm controller": their absence is an ERROR, as is an exempt name
that does not resolve, a cluster key that is missing or readable by others,
and a node none of whose addresses is in the cluster subnets (a subnet
typo). A reload of a file with an ERROR is refused; an agent that starts
with one enforces the rest and reports it.

--remote checks a file for other nodes (on a configuration-management host):
names that do not resolve here are warnings; the key file, Slurm's accounts
and this host's addresses are not checked.

Exits 1 for an invalid file (file:line: key: message for each problem) or an
ERROR, 0 otherwise (also with warnings, unless --strict). Nothing is applied.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := config.Load(configPath)
			if err != nil {
				return &ExitError{1, "invalid configuration:\n" + err.Error()}
			}
			out := cmd.OutOrStdout()
			var fs []config.Finding
			if !remote {
				// Hostlist node names, looked up here as status --all
				// would (their findings are part of Findings).
				cfg.ResolveNodes(nil)
			}
			fmt.Fprint(out, cfg.Describe(identity.System()))
			fmt.Fprintf(out, "# config sha256 %s\n", cfg.SHA256)
			var problems, warnings int
			opts := config.CheckOptions{SlurmConf: slurmConf, Elsewhere: remote}
			if !remote {
				opts.LocalAddrs = localAddrs()
			}
			fs = append(fs, cfg.Findings(opts)...)
			if f, ok := userwall.KeyFinding(cfg); ok && !remote {
				fs = append(fs, f)
			}
			fs = append(fs, testFindings(cfg)...)
			for _, f := range fs {
				fmt.Fprintf(out, "# %s: %s\n", f.Level, f.String(configPath))
				if f.Severity == config.Problem {
					problems++
				} else {
					warnings++
				}
			}
			switch {
			case problems > 0:
				return &ExitError{1, fmt.Sprintf("%s: %d error(s), %d warning(s)", configPath, problems, warnings)}
			case warnings > 0 && strict:
				return &ExitError{1, fmt.Sprintf("%s: %d warning(s) (--strict)", configPath, warnings)}
			case warnings > 0:
				fmt.Fprintf(out, "# %s: OK, %d warning(s)\n", configPath, warnings)
			default:
				fmt.Fprintf(out, "# %s: OK\n", configPath)
			}
			return nil
		},
	}
	check.Flags().StringVar(&slurmConf, "slurm-conf", config.SlurmConfPath(), `Slurm's configuration, for its accounts ("" = do not check; a missing file = no Slurm)`)
	check.Flags().BoolVar(&strict, "strict", false, "exit 1 on warnings too")
	check.Flags().BoolVar(&remote, "remote", false, "check the file for other nodes: names not resolvable here are warnings; key file, Slurm and this host's addresses not checked")
	configCmd.AddCommand(check)
	return configCmd
}

// localAddrs are this node's addresses (nil if unreadable: not checked);
// a variable for the tests, whose host is no cluster node.
var localAddrs = func() []netip.Addr {
	as, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	out := []netip.Addr{}
	for _, a := range as {
		if p, err := netip.ParsePrefix(a.String()); err == nil {
			out = append(out, p.Addr())
		}
	}
	return out
}

// testFindings runs the policy's tests: each failure is an ERROR (the
// agent refuses such a policy), each site rule no test covers a WARNING.
func testFindings(cfg *config.Config) []config.Finding {
	var out []config.Finding
	results, _ := cfg.RunTests(nil)
	for i, r := range results {
		if r.Err != nil {
			out = append(out, config.Finding{Severity: config.Problem, Level: config.Problem.String(), Key: fmt.Sprintf("test %q", r.Name),
				Line: r.Line, Msg: fmt.Sprintf("failed (%s, test %d): %v", r.Where(), i+1, r.Err)})
		}
	}
	for _, r := range cfg.Uncovered() {
		out = append(out, config.Finding{Severity: config.Warning, Level: config.Warning.String(), Key: "rule " + strconv.Quote(r.Name),
			Line: r.Line, Msg: fmt.Sprintf("no [[test]] expects this rule to decide (%s)", r.Where())})
	}
	return out
}
