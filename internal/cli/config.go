package cli

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
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
contact slurm controller": their absence is an ERROR.

Exits 1 for an invalid file (file:line: key: message for each problem) or an
ERROR, 0 otherwise (also with warnings, unless --strict). Nothing is applied.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := config.Load(configPath)
			if err != nil {
				return &ExitError{1, "invalid configuration:\n" + err.Error()}
			}
			out := cmd.OutOrStdout()
			fmt.Fprint(out, cfg.Describe(identity.System()))
			fmt.Fprintf(out, "# config sha256 %s\n", cfg.SHA256)
			var problems, warnings int
			fs := cfg.Findings(config.CheckOptions{SlurmConf: slurmConf})
			if f, ok := keyFinding(cfg); ok {
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
	configCmd.AddCommand(check)
	return configCmd
}

// keyFinding checks the cluster key as the agent will load it: without a
// usable key no identity from another node is trusted, so every user's
// cross-node traffic is refused. (Skipped when the caller may not read it.)
func keyFinding(cfg *config.Config) (config.Finding, bool) {
	if len(cfg.Policy.ClusterSubnets) == 0 {
		return config.Finding{}, false
	}
	path := cmp.Or(cfg.Cluster.KeyFile, config.DefaultKeyFile)
	_, err := userwall.LoadKeys(path)
	if err == nil || errors.Is(err, fs.ErrPermission) {
		return config.Finding{}, false
	}
	return config.Finding{Severity: config.Problem, Level: config.Problem.String(), Key: "cluster.key_file", Line: cfg.KeyLine("cluster.key_file"),
		Msg: fmt.Sprintf("%v: identity from other nodes is not trusted, users' cross-node traffic is refused "+
			"(make one: (umask 077; openssl rand -hex 16 > %s), the same on every node)", err, path)}, true
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
