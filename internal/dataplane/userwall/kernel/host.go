package kernel

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/sys/netns"
)

// NetnsCookie returns the cookie of the caller's network namespace (what
// bpf_get_netns_cookie returns for its sockets).
func NetnsCookie() (uint64, error) { return netns.Cookie() }

func IsBPFFS(path string) bool {
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
	if IsBPFFS(dir) {
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

// FindBPFFS locates an existing bpffs for read-only use (status, uninstall):
// dir itself, or dir as the running agent sees it (/proc/PID/root/...) when
// the caller is in another mount namespace.
func FindBPFFS(dir string, agentPid int) (string, bool) {
	if IsBPFFS(dir) {
		return dir, true
	}
	if agentPid > 0 {
		p := filepath.Join(fmt.Sprintf("/proc/%d/root", agentPid), dir)
		if IsBPFFS(p) {
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
