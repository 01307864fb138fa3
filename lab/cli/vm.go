package cli

import (
	"net/netip"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/palisade-hpc/palisade/lab/vm"
)

// The vm commands are plumbing of `palisade-lab testbed up --vm`: the host-side
// hub that owns qemu, the guest-side agent, and the relay `testbed exec`
// uses (hidden; see docs/uvn.md).
func vmCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:    "vm",
		Short:  "VM plumbing for `testbed up --vm` (hub, agent, exec, kernel)",
		Hidden: true,
	}
	var (
		dir   string
		owner int
	)
	hub := &cobra.Command{
		Use:  "hub --dir DIR [--owner PID]",
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error { return vm.RunHub(dir, owner) },
	}
	hub.Flags().StringVar(&dir, "dir", "", "VM directory")
	hub.Flags().IntVar(&owner, "owner", 0, "stop the VM when this process exits (0: run until `testbed down`)")
	var port string
	agent := &cobra.Command{
		Use:                "agent --port DEV [pal.*=...]",
		DisableFlagParsing: true,
		RunE: func(_ *cobra.Command, args []string) error {
			var words []string
			for i := 0; i < len(args); i++ {
				if args[i] == "--port" && i+1 < len(args) {
					port = args[i+1]
					i++
					continue
				}
				words = append(words, args[i])
			}
			return vm.RunAgent(port, vm.ParseAgentArgs(words))
		},
	}
	var node, user string
	var sh bool
	execCmd := &cobra.Command{
		Use:  "exec --dir DIR (--node NODE [--user USER] | --sh) -- ARGV...",
		Args: cobra.ArbitraryArgs,
		RunE: func(_ *cobra.Command, args []string) error {
			req := vm.Request{Op: "exec", Node: node, User: user, Argv: args}
			if sh {
				req = vm.Request{Op: "sh", Argv: args}
			}
			// A relay exits with the guest command's own code and prints
			// nothing of its own.
			os.Exit(vm.ExecMain(dir, req))
			return nil
		},
	}
	execCmd.Flags().StringVar(&dir, "dir", "", "VM directory")
	execCmd.Flags().StringVar(&node, "node", "", "node")
	execCmd.Flags().StringVar(&user, "user", "", "user (default root)")
	execCmd.Flags().BoolVar(&sh, "sh", false, "run in the guest's root namespaces, not on a node")
	var series string
	kernel := &cobra.Command{
		Use:   "kernel [--version 6.1|6.12]",
		Short: "Download and prepare the guest kernel into the cache (" + vm.CacheDir() + ")",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			k, err := vm.PrepareKernel(cmd.Context(), series)
			if err != nil {
				return err
			}
			cmd.Printf("kernel %s: %s, initrd %s\n", k.Version, k.Image, k.Initrd)
			return nil
		},
	}
	kernel.Flags().StringVar(&series, "version", vm.DefaultKernel, "guest kernel series: "+strings.Join(vm.KernelSeries(), ", "))
	var to, src, dst, payload string
	var vni uint32
	var dport uint16
	inject := &cobra.Command{
		Use:   "inject --to ADDR:PORT --vni N --src IP --dst IP --dport P --payload TEXT",
		Short: "Send a crafted VXLAN frame from an ordinary UDP socket (the attack the uvn guard stops)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			t, err := netip.ParseAddrPort(to)
			if err != nil {
				return err
			}
			s, err := netip.ParseAddr(src)
			if err != nil {
				return err
			}
			d, err := netip.ParseAddr(dst)
			if err != nil {
				return err
			}
			if err := vm.Inject(t, vm.VXLANFrame(vni, s, d, dport, []byte(payload))); err != nil {
				return err
			}
			cmd.Println("sent")
			return nil
		},
	}
	inject.Flags().StringVar(&to, "to", "", "VXLAN endpoint ADDR:PORT")
	inject.Flags().Uint32Var(&vni, "vni", 0, "victim's VNI")
	inject.Flags().StringVar(&src, "src", "", "inner source IPv4")
	inject.Flags().StringVar(&dst, "dst", "", "inner destination IPv4")
	inject.Flags().Uint16Var(&dport, "dport", 0, "inner UDP destination port")
	inject.Flags().StringVar(&payload, "payload", "INJECTED", "payload")
	cmd.AddCommand(hub, agent, execCmd, kernel, inject)
	return cmd
}
