package vm

import (
	"bytes"
	"compress/gzip"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/cavaliergopher/cpio"
)

// TestEtcSnapshot: the guest's /etc is the host's as archived after the
// kernel's initramfs — accounts, symlinks and modes kept — without the
// account tools' lock and temporary files, and with the host testbeds'
// per-namespace directories empty.
func TestEtcSnapshot(t *testing.T) {
	dir := t.TempDir()
	etc := filepath.Join(dir, "etc")
	files := map[string]string{
		"passwd": "root:x:0:0::/root:/bin/sh\n", "gshadow": "root:*::\n", "hostname": "h\n",
		"gshadow.lock": "123", "passwd.4242": "half", "group+": "half", "subuid.lock": "1",
		"passwd-": "backup\n", "group.d/x": "kept\n", "netns/palx-node1/resolv.conf": "host testbed's\n",
		"palisade/palisade.toml": "host testbed's\n", "ssh/sshd_config": "Port 22\n",
	}
	for n, c := range files {
		p := filepath.Join(etc, n)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(filepath.Join(etc, "gshadow"), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/usr/share/zoneinfo/UTC", filepath.Join(etc, "localtime")); err != nil {
		t.Fatal(err)
	}
	base := []byte("the kernel's initramfs\n")
	if err := os.WriteFile(filepath.Join(dir, "base"), base, 0o644); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, "initrd.img")
	if err := writeBootInitrd(filepath.Join(dir, "base"), etc, dst); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(dst)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(b, base) {
		t.Fatalf("%s does not start with the base initramfs", dst)
	}
	zr, err := gzip.NewReader(bytes.NewReader(b[len(base):]))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	modes := map[string]cpio.FileMode{}
	r := cpio.NewReader(zr)
	for {
		h, err := r.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		c, _ := io.ReadAll(r)
		if h.Mode&cpio.ModeType == cpio.TypeSymlink {
			c = []byte(h.Linkname) // the reader takes the body as the target
		}
		got[h.Name], modes[h.Name] = string(c), h.Mode
	}
	want := map[string]string{
		"etcsnap": "", "etcsnap/passwd": files["passwd"], "etcsnap/gshadow": files["gshadow"], "etcsnap/hostname": "h\n",
		"etcsnap/passwd-": "backup\n", "etcsnap/group.d": "", "etcsnap/group.d/x": "kept\n",
		"etcsnap/netns": "", "etcsnap/palisade": "", "etcsnap/ssh": "", "etcsnap/ssh/sshd_config": "Port 22\n",
		"etcsnap/localtime": "/usr/share/zoneinfo/UTC", "etcsnap/.pwd.lock": "",
	}
	for n, c := range want {
		if g, ok := got[n]; !ok || g != c {
			t.Errorf("%s: got %q (present %v), want %q", n, g, ok, c)
		}
	}
	for n := range got {
		if _, ok := want[n]; !ok {
			t.Errorf("%s archived: it must not reach the guest", n)
		}
	}
	if m := modes["etcsnap/gshadow"]; m != cpio.TypeReg|0o640 {
		t.Errorf("gshadow mode %o, want %o", m, cpio.TypeReg|0o640)
	}
	if m := modes["etcsnap/localtime"]; m&cpio.ModeType != cpio.TypeSymlink {
		t.Errorf("localtime mode %o: not a symlink", m)
	}
}
