package vm

import (
	"bufio"
	"compress/gzip"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/cavaliergopher/cpio"
	"golang.org/x/sys/unix"
)

// The guest's /etc is its own: a snapshot of the host's, taken when the VM
// boots and carried in the initramfs (the init script binds it over the
// overlay's /etc). Through the 9p lower layer the guest saw the host's live
// /etc, cached (cache=loose): a `groupadd` on the host while the guest
// testbed created its users left the guest looking at the host's transient
// /etc/gshadow.lock ("groupadd: cannot lock /etc/gshadow"), and host
// testbeds coming and going changed the guest's accounts and /etc/netns
// under it.

// etcSnapDir is where the snapshot sits in the initramfs.
const etcSnapDir = "etcsnap"

// etcSkip are host directories whose contents are the host testbeds'
// (per-namespace overlays, node configurations): the guest gets them empty.
var etcSkip = map[string]bool{"netns": true, "palisade": true}

// withEtcSnapshot replaces argv's -initrd with one of dir's own: the same
// initramfs followed by a cpio archive of the host's /etc as it is now.
func withEtcSnapshot(argv []string, dir string) error {
	i := -1
	for j := range argv[:len(argv)-1] {
		if argv[j] == "-initrd" {
			i = j + 1
		}
	}
	if i < 0 {
		return fmt.Errorf("qemu arguments without -initrd")
	}
	dst := filepath.Join(dir, "initrd.img")
	if err := writeBootInitrd(argv[i], "/etc", dst); err != nil {
		return fmt.Errorf("guest /etc snapshot: %w", err)
	}
	argv[i] = dst
	return nil
}

// writeBootInitrd writes base followed by a gzip'd cpio archive of etc
// (under etcSnapDir): the kernel unpacks concatenated archives in turn.
func writeBootInitrd(base, etc, dst string) error {
	f, err := os.Create(dst + ".tmp")
	if err != nil {
		return err
	}
	defer os.Remove(dst + ".tmp")
	defer f.Close()
	b, err := os.Open(base)
	if err != nil {
		return err
	}
	_, err = io.Copy(f, b)
	b.Close()
	if err != nil {
		return err
	}
	bw := bufio.NewWriter(f)
	zw := gzip.NewWriter(bw)
	if err := snapshotEtc(etc, cpio.NewWriter(zw)); err != nil {
		return err
	}
	if err := zw.Close(); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(dst+".tmp", dst)
}

// snapshotEtc archives etc holding the account databases' lock (glibc's
// lckpwdf: a write lock on /etc/.pwd.lock, which shadow-utils' useradd,
// groupadd, userdel ... take before they touch passwd, group, shadow or
// gshadow): the guest gets the databases as of one moment and none of those
// tools' transient lock and temporary files.
func snapshotEtc(etc string, w *cpio.Writer) error {
	// A process's POSIX record locks go when it closes any descriptor of the
	// file: the walk below must not open .pwd.lock (it writes it empty).
	lf, err := os.OpenFile(filepath.Join(etc, ".pwd.lock"), os.O_WRONLY|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer lf.Close()
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: io.SeekStart}
	if err := unix.FcntlFlock(lf.Fd(), unix.F_SETLKW, &lk); err != nil {
		return fmt.Errorf("lock %s: %w", lf.Name(), err)
	}
	defer func() {
		lk.Type = unix.F_UNLCK
		unix.FcntlFlock(lf.Fd(), unix.F_SETLK, &lk)
	}()
	err = filepath.WalkDir(etc, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(etc, p)
		top := rel != "." && !strings.Contains(rel, "/")
		if top && transient(rel) {
			return nil
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		h := &cpio.Header{Name: etcSnapDir, Mode: cpio.FileMode(st.Mode), Uid: int(st.Uid), Guid: int(st.Gid),
			ModTime: time.Unix(st.Mtim.Unix()), Links: 1}
		if rel != "." {
			h.Name += "/" + rel
		}
		var data []byte
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
		case unix.S_IFLNK:
			t, err := os.Readlink(p)
			if err != nil {
				return err
			}
			data = []byte(t)
		case unix.S_IFREG:
			if rel != ".pwd.lock" { // never opened: see above
				if data, err = os.ReadFile(p); err != nil {
					return err
				}
			}
		default:
			return nil // sockets, fifos, devices: nothing the guest needs
		}
		h.Size = int64(len(data))
		if err := w.WriteHeader(h); err != nil {
			return err
		}
		if _, err := w.Write(data); err != nil {
			return err
		}
		if d.IsDir() && top && etcSkip[rel] {
			return fs.SkipDir
		}
		return nil
	})
	if err != nil {
		return err
	}
	return w.Close()
}

// transient reports shadow-utils' lock and temporary files (passwd.lock,
// group.1234, shadow+), left by a tool that was interrupted: they must not
// reach the guest, whose own tools would take them for a lock held by
// someone else.
func transient(name string) bool {
	for _, db := range []string{"passwd", "group", "shadow", "gshadow", "subuid", "subgid"} {
		rest, ok := strings.CutPrefix(name, db)
		if !ok {
			continue
		}
		if rest == ".lock" || rest == "+" {
			return true
		}
		if n, ok := strings.CutPrefix(rest, "."); ok && n != "" && strings.Trim(n, "0123456789") == "" {
			return true
		}
	}
	return false
}
