package cli

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/identity"
)

func policyCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "policy",
		Short: "Work with the site's policy rules and their tests",
	}
	var (
		passwd, group string
		strict        bool
	)
	test := &cobra.Command{
		Use:   "test [FILE]",
		Short: "Run the policy's [[test]] entries offline against FILE (default --config)",
		Long: `Load FILE (default: --config) with the files it includes, decide every
[[test]] with policy.Decide, the decision every data plane enforces, and print
each verdict and deciding rule. Nothing is applied and no agent is needed: a
site runs it in the CI of its policy repository on every change. Users and
groups come from NSS, or with --passwd and --group from files in passwd(5) and
group(5) format (a CI runner without the directory).

Exits 1 if the file is invalid or a test fails (FILE:LINE: test[N]: ...); with
--strict also when a site rule is decided by no test.`,
		Example: "  palisade policy test\n  palisade policy test policy/palisade.toml --passwd ci/passwd --group ci/group",
		Args:    cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			path := configPath
			if len(args) == 1 {
				path = args[0]
			}
			var res identity.Resolver = identity.System()
			if passwd != "" || group != "" {
				if passwd == "" || group == "" {
					return errors.New("--passwd and --group go together")
				}
				t, err := identity.ReadFiles(passwd, group)
				if err != nil {
					return err
				}
				res = t
			}
			data, err := os.ReadFile(path)
			if err != nil {
				return &ExitError{1, err.Error()}
			}
			cfg, err := config.Parse(path, data, res)
			if err != nil {
				return &ExitError{1, "invalid configuration:\n" + err.Error()}
			}
			out := cmd.OutOrStdout()
			results, terr := cfg.RunTests(res)
			failed := 0
			for _, r := range results {
				word := "PASS"
				if r.Err != nil {
					word = "FAIL"
					failed++
				}
				verdict := "deny"
				if r.Got.Allow {
					verdict = "allow"
				}
				fmt.Fprintf(out, "%s  %s: %s  %s by rule %s\n", word, r.Where(), r.Name, verdict, r.Got.Rule)
				if r.Err != nil {
					fmt.Fprintf(out, "      %v\n", r.Err)
				}
			}
			uncovered := cfg.Uncovered()
			for _, r := range uncovered {
				fmt.Fprintf(out, "# WARNING: %s: rule %q: no test expects this rule to decide\n", r.Where(), r.Name)
			}
			fmt.Fprintf(out, "# %s: %d site rule(s), %d test(s), %d failed, %d rule(s) untested\n",
				path, len(cfg.Policy.Rules), len(results), failed, len(uncovered))
			switch {
			case terr != nil:
				return &ExitError{1, terr.Error()}
			case strict && len(uncovered) > 0:
				return &ExitError{1, fmt.Sprintf("%s: %d rule(s) untested (--strict)", path, len(uncovered))}
			}
			return nil
		},
	}
	test.Flags().StringVar(&passwd, "passwd", "", "resolve users from this passwd(5) file instead of NSS")
	test.Flags().StringVar(&group, "group", "", "resolve groups from this group(5) file instead of NSS")
	test.Flags().BoolVar(&strict, "strict", false, "exit 1 when a site rule is decided by no test")
	cmd.AddCommand(test)
	return cmd
}
