package userwall

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
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
	if p := mountPoint("/proc/1/mounts", "cgroup2", "/sys/fs/cgroup"); p != "" {
		return filepath.Join("/proc/1/root", p), nil
	}
	return "", errors.New("no cgroup v2 hierarchy mounted (mount -t cgroup2 none /sys/fs/cgroup/unified)")
}

func isBPFFS(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && uint32(st.Type) == unix.BPF_FS_MAGIC
}

// BPFFS returns a bpffs mount shared with the rest of the host, mounting one
// at dir (normally /sys/fs/bpf) in init's mount namespace if none is there.
// Pins must live in the host's bpffs: every bpffs mount is its own instance,
// and an agent restarted by `ip netns exec` gets a fresh sysfs. It is never
// unmounted: other tools share it.
func BPFFS(dir string) (string, error) {
	if isBPFFS(dir) {
		return dir, nil
	}
	host := filepath.Join("/proc/1/root", dir)
	if isBPFFS(host) {
		return host, nil
	}
	self, _ := os.Readlink("/proc/self/ns/mnt")
	init, _ := os.Readlink("/proc/1/ns/mnt")
	if self == init {
		if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
			return "", fmt.Errorf("mount bpffs on %s: %w", dir, err)
		}
		return dir, nil
	}
	out, err := exec.Command("nsenter", "--mount=/proc/1/ns/mnt", "--", "mount", "-t", "bpf", "-o", "mode=0700", "bpf", dir).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("mount bpffs on %s in the host mount namespace: %v: %s", dir, err, out)
	}
	if !isBPFFS(host) {
		return "", fmt.Errorf("bpffs on %s not visible after mount", dir)
	}
	return host, nil
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
