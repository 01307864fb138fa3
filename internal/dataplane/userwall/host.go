package userwall

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// NetnsCookie returns the cookie of the caller's network namespace (what
// bpf_get_netns_cookie returns for its sockets).
func NetnsCookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	c, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	if err != nil {
		return 0, fmt.Errorf("SO_NETNS_COOKIE: %w (kernel ≥ 5.14 needed)", err)
	}
	return c, nil
}

// mountPoint finds the mount point of a filesystem type in a mounts file.
func mountPoint(mounts, fstype, prefer string) string {
	f, err := os.Open(mounts)
	if err != nil {
		return ""
	}
	defer f.Close()
	found := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 3 || fs[2] != fstype {
			continue
		}
		if prefer == "" || fs[1] == prefer {
			return fs[1]
		}
		if found == "" {
			found = fs[1]
		}
	}
	return found
}

// CgroupRoot finds the root of the cgroup v2 hierarchy: /sys/fs/cgroup on a
// pure v2 host, /sys/fs/cgroup/unified on a hybrid one, anything /proc/mounts
// names otherwise. A process in a private mount namespace with a fresh sysfs
// (`ip netns exec`) sees no cgroup mount: then init's view is used, which is
// the same hierarchy.
func CgroupRoot() (string, error) {
	if p := mountPoint("/proc/self/mounts", "cgroup2", "/sys/fs/cgroup"); p != "" {
		return p, nil
	}
	return "", errors.New("no cgroup v2 hierarchy mounted in this mount namespace (a fresh sysfs from `ip netns exec`? enter the node with `nsenter --net=/run/netns/NS` instead; or mount -t cgroup2 none /sys/fs/cgroup/unified)")
}

func isBPFFS(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && uint32(st.Type) == unix.BPF_FS_MAGIC
}

// BPFFS returns the bpf filesystem at dir (normally /sys/fs/bpf), mounting
// it if absent. It is never unmounted: other tools share it. Pins must live
// in the host's bpffs, because every bpffs mount is its own instance: an
// agent started with a fresh sysfs (`ip netns exec`) would pin where no later
// command finds them, so site units and the testbed start the agent in the
// host's mount namespace (see docs/userwall.md).
func BPFFS(dir string) (string, error) {
	if isBPFFS(dir) {
		return dir, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		return "", fmt.Errorf("mount bpffs on %s: %w", dir, err)
	}
	return dir, nil
}

// findBPFFS locates an existing bpffs for read-only use (status, uninstall):
// dir itself, or dir as the running agent sees it (/proc/PID/root/...) when
// the caller is in another mount namespace.
func findBPFFS(dir string, agentPid int) (string, bool) {
	if isBPFFS(dir) {
		return dir, true
	}
	if agentPid > 0 {
		p := filepath.Join(fmt.Sprintf("/proc/%d/root", agentPid), dir)
		if isBPFFS(p) {
			return p, true
		}
	}
	return dir, false
}

// PinDir is where one namespace's programs, links and maps are pinned.
func PinDir(bpffs string, cookie uint64) string {
	return filepath.Join(bpffs, "palisade", strconv.FormatUint(cookie, 10))
}

// LSMActive reports whether the bpf LSM is enabled (lsm= list), and how it
// was determined.
func LSMActive() (bool, string) {
	for _, p := range []string{"/sys/kernel/security/lsm", "/proc/1/root/sys/kernel/security/lsm"} {
		if b, err := os.ReadFile(p); err == nil {
			return strings.Contains(","+strings.TrimSpace(string(b))+",", ",bpf,"), p
		}
	}
	return false, "unknown (securityfs not mounted)"
}
