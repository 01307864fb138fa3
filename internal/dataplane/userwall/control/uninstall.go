package control

import (
	"errors"
	"net/netip"
	"os"
	"time"

	"github.com/palisade-hpc/palisade/internal/dataplane/userwall/kernel"
	"github.com/palisade-hpc/palisade/internal/sys/nldump"
	"github.com/palisade-hpc/palisade/internal/sys/pidfd"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Uninstall stops the namespace's running agent (if any) and removes every
// program, link, map and nft table it made.
func Uninstall(o Options) error {
	cfg, err := o.LoadConfig()
	bpffsDir, pidFile := "/sys/fs/bpf", ""
	if err == nil {
		bpffsDir, pidFile = cfg.Agent.BPFFS, cfg.Agent.PidFile
	} else if o.PidFile != "" {
		pidFile = o.PidFile
	}
	fs, fsOK := kernel.FindBPFFS(bpffsDir, 0)
	if pidFile != "" {
		if pid := ReadPid(pidFile); pid != 0 && pid != os.Getpid() {
			if !fsOK {
				fs, fsOK = kernel.FindBPFFS(bpffsDir, pid)
			}
			if exited, _ := pidfd.Signal(pid, unix.SIGTERM, 5*time.Second); !exited {
				pidfd.Signal(pid, unix.SIGKILL, 5*time.Second)
			}
			os.Remove(pidFile)
		}
		os.Remove(pidFile + ".lock")
		removeState(pidFile)
	}
	cookie, err := kernel.NetnsCookie()
	if err != nil {
		return err
	}
	var errs []error
	if fsOK {
		errs = append(errs, kernel.RemovePins(kernel.PinDir(fs, cookie)))
		kernel.CollectStale(fs)
	}
	errs = append(errs, kernel.RemoveTCFilters())
	errs = append(errs, kernel.RemoveNft())
	if cfg != nil {
		errs = append(errs, restoreRouteMTU(cfg.Policy.ClusterSubnets))
	}
	return errors.Join(errs...)
}

// restoreRouteMTU removes the MTU the agent gave the routes to stamped
// destinations (SyncRouteMTU), on every device it could have managed.
func restoreRouteMTU(cluster []netip.Prefix) error {
	links, err := nldump.Retry(netlink.LinkList)
	if err != nil {
		return err
	}
	l2 := map[int]int{}
	for _, l := range links {
		if n, ok := kernel.L2HeaderLen(l.Attrs().EncapType); ok {
			l2[l.Attrs().Index] = n
		}
	}
	_, err = kernel.SyncRouteMTU(cluster, l2, true)
	return err
}
