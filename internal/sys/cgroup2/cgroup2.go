// Package cgroup2 finds the root of the cgroup v2 hierarchy, the one place
// that knows where it is: /sys/fs/cgroup on a pure v2 host,
// /sys/fs/cgroup/unified on a hybrid one, whatever the mount table names
// otherwise, or nowhere at all (a fresh sysfs from `ip netns exec`).
package cgroup2

import (
	"errors"
	"fmt"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/sys/procfs"
)

// ErrNotMounted: no cgroup2 filesystem in this mount namespace.
var ErrNotMounted = errors.New("no cgroup v2 hierarchy mounted in this mount namespace (a fresh sysfs from `ip netns exec`? enter the node with `nsenter --net=/run/netns/NS` instead; or mount -t cgroup2 none /sys/fs/cgroup/unified)")

// MountPoint is where the cgroup v2 hierarchy is mounted in the caller's
// mount namespace (/sys/fs/cgroup preferred when several are). Callers that
// hand a path to others, or whose other state (bpffs pins) must be the
// host's, want this; its absence means the caller runs in a private mount
// namespace.
func MountPoint() (string, error) {
	p, err := mountPoint(0, "/sys/fs/cgroup")
	if err != nil {
		return "", err
	}
	if p == "" {
		return "", ErrNotMounted
	}
	return p, nil
}

// InitMountPoint is MountPoint in init's mount namespace: a command run
// with a fresh sysfs (`ip netns exec`, a testbed login) has no cgroup mount
// of its own, yet the kernel's hierarchy may be mounted for the host.
func InitMountPoint() (string, error) {
	p, err := mountPoint(1, "/sys/fs/cgroup")
	if err != nil {
		return "", err
	}
	if p == "" {
		return "", ErrNotMounted
	}
	return p, nil
}

// mountPoint finds the cgroup2 mount in pid's mount namespace (0: the
// caller's): prefer if it is one, else the first.
func mountPoint(pid int, prefer string) (string, error) {
	ps, err := procfs.MountPoints(pid, "cgroup2")
	if err != nil {
		return "", err
	}
	return choose(ps, prefer), nil
}

// choose is prefer if it is one of the mount points, else the first ("":
// none).
func choose(points []string, prefer string) string {
	switch {
	case len(points) == 0:
		return ""
	case slices.Contains(points, prefer):
		return prefer
	}
	return points[0]
}

// Open returns a directory file descriptor of the hierarchy's root (of the
// caller's cgroup namespace) on a private, detached mount made with
// fsopen/fsmount. It works the same wherever cgroup2 is mounted, and where it
// is not (`ip netns exec`, which remounts /sys without any cgroup mount, or
// a host that never mounted it); being attached nowhere, it leaks nothing.
// The caller closes it.
func Open() (int, error) {
	fsfd, err := unix.Fsopen("cgroup2", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen cgroup2: %w", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return -1, fmt.Errorf("fsconfig cgroup2: %w", err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsmount cgroup2: %w", err)
	}
	return mfd, nil
}
