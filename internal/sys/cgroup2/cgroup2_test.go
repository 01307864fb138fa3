package cgroup2

import (
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

func TestMountPointChoice(t *testing.T) {
	for _, c := range []struct {
		name   string
		points []string
		want   string
	}{
		{"pure v2", []string{"/sys/fs/cgroup"}, "/sys/fs/cgroup"},
		{"hybrid", []string{"/sys/fs/cgroup/unified"}, "/sys/fs/cgroup/unified"},
		{"elsewhere, then preferred", []string{"/mnt/cg", "/sys/fs/cgroup"}, "/sys/fs/cgroup"},
		{"elsewhere only", []string{"/mnt/cg"}, "/mnt/cg"},
		{"none (v1 only, ip netns exec)", nil, ""},
	} {
		if got := choose(c.points, "/sys/fs/cgroup"); got != c.want {
			t.Errorf("%s: %q, want %q", c.name, got, c.want)
		}
	}
	if _, err := mountPoint(1<<30, "/sys/fs/cgroup"); err == nil {
		t.Error("an unreadable mount table is not an error")
	}
}

// TestSameRoot: on this host the mount point and the detached mount are
// the same hierarchy root (same superblock and inode), a cgroup2 one.
func TestSameRoot(t *testing.T) {
	mp, err := MountPoint()
	if errors.Is(err, ErrNotMounted) {
		t.Skip("cgroup2 not mounted in this mount namespace")
	}
	if err != nil {
		t.Fatal(err)
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(mp, &fs); err != nil || fs.Type != unix.CGROUP2_SUPER_MAGIC {
		t.Fatalf("%s: statfs type %#x %v, want cgroup2", mp, fs.Type, err)
	}
	if os.Geteuid() != 0 {
		t.Skip("Open needs root (fsmount)")
	}
	fd, err := Open()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	var a, b unix.Stat_t
	if err := unix.Fstat(fd, &a); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(mp, &b); err != nil {
		t.Fatal(err)
	}
	if a.Dev != b.Dev || a.Ino != b.Ino {
		t.Errorf("Open's root (dev %d ino %d) is not %s (dev %d ino %d)", a.Dev, a.Ino, mp, b.Dev, b.Ino)
	}
	if err := unix.Faccessat(fd, "cgroup.procs", unix.R_OK, 0); err != nil {
		t.Errorf("no cgroup.procs at Open's root: %v", err)
	}
}
