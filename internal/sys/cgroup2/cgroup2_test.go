package cgroup2

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func TestMountPointParse(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct{ name, mounts, want string }{
		{"pure v2", "sysfs /sys sysfs rw 0 0\ncgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n", "/sys/fs/cgroup"},
		{"hybrid", "tmpfs /sys/fs/cgroup tmpfs ro 0 0\ncgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n", "/sys/fs/cgroup/unified"},
		{"elsewhere, then preferred", "cgroup2 /mnt/cg cgroup2 rw 0 0\ncgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n", "/sys/fs/cgroup"},
		{"elsewhere only", "cgroup2 /mnt/cg cgroup2 rw 0 0\n", "/mnt/cg"},
		{"v1 only", "cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n", ""},
		{"none (ip netns exec)", "sysfs /sys sysfs rw 0 0\n", ""},
	} {
		p := filepath.Join(dir, "mounts")
		if err := os.WriteFile(p, []byte(c.mounts), 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := mountPoint(p, "/sys/fs/cgroup")
		if err != nil || got != c.want {
			t.Errorf("%s: %q %v, want %q", c.name, got, err, c.want)
		}
	}
	if _, err := mountPoint(filepath.Join(dir, "absent"), "/sys/fs/cgroup"); err == nil {
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
