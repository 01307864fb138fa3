package cli

import (
	"cmp"
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/internal/config"
	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
)

// keyCommand manages the cluster key that seals identity stamps.
func keyCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "key",
		Short: "Manage the cluster key that seals every identity stamp (docs/userwall.md)",
	}
	var force bool
	gen := &cobra.Command{
		Use:   "generate [FILE]",
		Short: "Write a new random cluster key to FILE (mode 0600), or print it",
		Long: `Writes a new 128-bit cluster key. Distribute the same file to every node, owned by root,
mode 0600 (as munge.key), at [cluster] key_file (default /etc/palisade/cluster.key).
To rotate without a gap: append the new key as a second line on every node and reload;
swap the two lines everywhere and reload; remove the old key and reload.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			body := kernel.GenerateKey()
			if len(args) == 0 {
				_, err := cmd.OutOrStdout().Write(body)
				return err
			}
			flags := os.O_WRONLY | os.O_CREATE | os.O_EXCL
			if force {
				flags = os.O_WRONLY | os.O_CREATE | os.O_TRUNC
			}
			f, err := os.OpenFile(args[0], flags, 0o600)
			if errors.Is(err, os.ErrExist) {
				return fmt.Errorf("%s exists: not overwritten (use --force, or rotate as `palisade key generate --help` says)", args[0])
			}
			if err != nil {
				return err
			}
			if err := f.Chmod(0o600); err != nil {
				f.Close()
				return err
			}
			if _, err := f.Write(body); err != nil {
				f.Close()
				return err
			}
			return f.Close()
		},
	}
	gen.Flags().BoolVar(&force, "force", false, "overwrite FILE")
	check := &cobra.Command{
		Use:   "check [FILE]",
		Short: "Check a cluster key file (permissions, format) and print the key ids",
		Long: `Check FILE, or the key file of --config ([cluster] key_file, default
/etc/palisade/cluster.key): owned by root, mode 0600 or stricter, one or two
keys. Prints which file was checked and the id of each key.`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			path := config.DefaultKeyFile
			if len(args) == 1 {
				path = args[0]
			} else {
				// The key the agent of --config loads (no file: the default).
				cfg, err := config.LoadOrDefault(configPath)
				if err != nil {
					return err
				}
				path = cmp.Or(cfg.Cluster.KeyFile, config.DefaultKeyFile)
			}
			keys, err := kernel.LoadKeys(path)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s:\n", path)
			for i, k := range keys {
				role := "seals and verifies"
				if i > 0 {
					role = "verifies (rotation)"
				}
				fmt.Fprintf(cmd.OutOrStdout(), "key %d: id %d, %s\n", i+1, k.ID(), role)
			}
			return nil
		},
	}
	cmd.AddCommand(gen, check)
	return cmd
}
