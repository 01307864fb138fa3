// Package vm runs a testbed inside a qemu VM booted with Debian's 6.1 kernel
// (which has VRF; this machine kind's kernel does not), with the host's root
// filesystem shared read-only over virtio-9p and an overlayfs with a tmpfs
// upper layer on top, so the guest can write /etc, /var and /run without
// touching the host. The guest has no network device at all; the host talks
// to it over one virtio-serial port, multiplexed (see proto.go).
//
// Recipe: shared/notes/vrf-vm.md (TCG unless the CPU really offers vmx/svm;
// ELF vmlinux through PVH; busybox initramfs; modules loaded on demand from
// the extracted package over 9p).
package vm

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
)

// CacheDir holds downloaded packages and the prepared kernel; override with
// $PALISADE_VM_CACHE.
func CacheDir() string {
	if d := os.Getenv("PALISADE_VM_CACHE"); d != "" {
		return d
	}
	return "/var/cache/palisade/vm"
}

// Kernel is a prepared guest kernel.
type Kernel struct {
	Version string // e.g. 6.1.0-56-amd64
	Image   string // ELF vmlinux (PVH entry) or bzImage
	Initrd  string
	// Modules is the extracted /lib/modules of the package; the guest
	// bind-mounts it (through the 9p root) so modprobe finds every module.
	Modules string
}

// initrdModules are loaded from the initramfs itself: enough to mount the
// host root. Everything else loads from the 9p-mounted module tree.
var initrdModules = []string{"virtio_pci", "9pnet_virtio", "9p"}

// GuestModules are loaded at boot (others auto-load on demand).
var GuestModules = []string{"overlay", "virtio_console", "vrf", "vxlan", "veth", "bridge",
	"nf_tables", "nft_chain_nat", "nft_masq", "nft_ct", "nft_reject_inet", "nf_conntrack",
	"tcp_diag", "udp_diag", "inet_diag", "unix_diag", "sch_ingress", "cls_bpf"}

func run(ctx context.Context, dir string, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return nil
}

// DefaultKernel is the guest kernel series when none is asked for: Debian
// 12's own.
const DefaultKernel = "6.1"

// Kernels are the series `--kernel` accepts, each with the Debian package
// whose dependency is the ABI-specific image: 6.1 is bookworm's
// linux-image-amd64, 6.12 its backport linux-image-6.12-amd64 (RHEL 10 and
// Debian 13 run 6.12).
var Kernels = map[string]string{
	"6.1":  "linux-image-amd64",
	"6.12": "linux-image-6.12-amd64",
	// Below userwall's floor: proves the agent refuses cleanly there.
	// Debian 11's kernel, from bullseye-security (foreignSuites).
	"5.10": "linux-image-amd64",
}

// foreignSuites are series from another Debian release: apt reads them
// from a private sources list and package lists under the cache, never
// from (or into) the host's apt configuration.
var foreignSuites = map[string]string{
	"5.10": "deb http://deb.debian.org/debian-security bullseye-security main",
}

// aptOpts are the apt options for series (none for the host's own suites).
func aptOpts(ctx context.Context, series string) ([]string, error) {
	line, ok := foreignSuites[series]
	if !ok {
		return nil, nil
	}
	dir := filepath.Join(CacheDir(), "apt-"+series)
	if err := os.MkdirAll(filepath.Join(dir, "lists", "partial"), 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "sources.list"), []byte(line+"\n"), 0o644); err != nil {
		return nil, err
	}
	opts := []string{"-o", "Dir::Etc::SourceList=" + filepath.Join(dir, "sources.list"), "-o", "Dir::Etc::SourceParts=/dev/null",
		"-o", "Dir::State::Lists=" + filepath.Join(dir, "lists")}
	if m, _ := filepath.Glob(filepath.Join(dir, "lists", "*_Packages*")); len(m) == 0 {
		if err := run(ctx, "/", "apt-get", append(append([]string{}, opts...), "update", "-qq")...); err != nil {
			return nil, err
		}
	}
	return opts, nil
}

// readyStamp marks a prepared kernel directory (v3: the init script mounts
// securityfs, 6.12 support).
const readyStamp = ".ready-v3"

// seriesOf is "6.1" for "6.1.0-56-amd64", "6.12" for "6.12.117+deb12-amd64".
func seriesOf(kver string) string {
	f := strings.SplitN(kver, ".", 3)
	if len(f) < 3 {
		return kver
	}
	return f[0] + "." + f[1]
}

// Prepared reports whether a kernel of series is ready in the cache (tests
// skip without one rather than download 100 MB).
func Prepared(series string) bool {
	if series == "" {
		series = DefaultKernel
	}
	m, _ := filepath.Glob(filepath.Join(CacheDir(), series+".*", readyStamp))
	return len(m) > 0
}

// kernelPackage resolves the ABI-specific package of a kernel series (the
// dependency of its meta package).
func kernelPackage(ctx context.Context, series string) (string, error) {
	if p := os.Getenv("PALISADE_VM_KERNEL_PKG"); p != "" && series == DefaultKernel {
		return p, nil
	}
	meta, ok := Kernels[series]
	if !ok {
		return "", fmt.Errorf("unknown guest kernel %q: want one of %s", series, strings.Join(KernelSeries(), ", "))
	}
	opts, err := aptOpts(ctx, series)
	if err != nil {
		return "", err
	}
	depends := func() string {
		out, err := exec.CommandContext(ctx, "apt-cache", append(append([]string{}, opts...), "depends", meta)...).Output()
		if err != nil {
			return ""
		}
		sc := bufio.NewScanner(bytes.NewReader(out))
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) == 2 && f[0] == "Depends:" && strings.HasPrefix(f[1], "linux-image-") && seriesOf(strings.TrimPrefix(f[1], "linux-image-")) == series {
				return f[1]
			}
		}
		return ""
	}
	if p := depends(); p != "" {
		return p, nil
	}
	// No package lists: use a kernel already prepared or downloaded, else
	// fetch the lists once.
	if m, _ := filepath.Glob(filepath.Join(CacheDir(), series+".*", readyStamp)); len(m) > 0 {
		return "linux-image-" + filepath.Base(filepath.Dir(m[len(m)-1])), nil
	}
	if m, _ := filepath.Glob(filepath.Join(CacheDir(), "linux-image-"+series+".*-amd64_*.deb")); len(m) > 0 {
		return strings.SplitN(filepath.Base(m[len(m)-1]), "_", 2)[0], nil
	}
	if err := run(ctx, "/", "apt-get", "update", "-qq"); err == nil {
		if p := depends(); p != "" {
			return p, nil
		}
	}
	return "", fmt.Errorf("cannot resolve the kernel package: `apt-cache depends %s` found nothing (run apt-get update)", meta)
}

// KernelSeries lists the accepted --kernel values.
func KernelSeries() []string {
	out := make([]string, 0, len(Kernels))
	for k := range Kernels {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// PrepareKernel downloads (apt-get download, never install) and prepares the
// guest kernel of a series ("" = DefaultKernel) once; later calls reuse the
// cache.
func PrepareKernel(ctx context.Context, series string) (*Kernel, error) {
	if series == "" {
		series = DefaultKernel
	}
	cache := CacheDir()
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return nil, err
	}
	pkg, err := kernelPackage(ctx, series)
	if err != nil {
		return nil, err
	}
	kver := strings.TrimPrefix(pkg, "linux-image-")
	dir := filepath.Join(cache, kver)
	// The initramfs is named for its scripts: a changed script builds a new
	// one next to the prepared kernel instead of booting a stale cache.
	k := &Kernel{Version: kver, Image: filepath.Join(dir, "vmlinux"), Initrd: filepath.Join(dir, "initrd-"+scriptsHash()+".img"),
		Modules: filepath.Join(dir, "root", "lib", "modules")}
	stamp := filepath.Join(dir, readyStamp)
	ready := func() bool {
		_, err1 := os.Stat(stamp)
		_, err2 := os.Stat(k.Initrd)
		return err1 == nil && err2 == nil
	}
	if ready() {
		return k, nil
	}
	// One preparer at a time (parallel test packages boot VMs).
	lock, err := os.OpenFile(filepath.Join(cache, kver+".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return nil, err
	}
	if ready() {
		return k, nil // prepared while we waited
	}
	if _, err := os.Stat(stamp); err == nil {
		busybox, err := findBusybox()
		if err != nil {
			return nil, err
		}
		if err := buildInitrd(ctx, busybox, filepath.Join(dir, "root"), kver, k.Initrd); err != nil {
			return nil, err
		}
		return k, nil
	}
	debs, _ := filepath.Glob(filepath.Join(cache, pkg+"_*.deb"))
	if len(debs) == 0 {
		opts, err := aptOpts(ctx, series)
		if err != nil {
			return nil, err
		}
		download := append(append([]string{}, opts...), "download", "-q", pkg)
		if err := run(ctx, cache, "apt-get", download...); err != nil {
			if err2 := run(ctx, "/", "apt-get", append(append([]string{}, opts...), "update", "-qq")...); err2 == nil {
				err = run(ctx, cache, "apt-get", download...)
			}
			if err != nil {
				return nil, fmt.Errorf("download %s: %w", pkg, err)
			}
		}
		debs, _ = filepath.Glob(filepath.Join(cache, pkg+"_*.deb"))
		if len(debs) == 0 {
			return nil, fmt.Errorf("apt-get download %s left no .deb in %s", pkg, cache)
		}
	}
	os.RemoveAll(dir)
	root := filepath.Join(dir, "root")
	if err := os.MkdirAll(root, 0o755); err != nil {
		return nil, err
	}
	if err := run(ctx, "/", "dpkg-deb", "-x", debs[len(debs)-1], root); err != nil {
		return nil, err
	}
	busybox, err := findBusybox()
	if err != nil {
		return nil, err
	}
	// 6.12's modules are xz-compressed; busybox modprobe loads plain .ko
	// files only, so decompress the tree once here.
	if err := decompressModules(ctx, root); err != nil {
		return nil, err
	}
	// The .deb ships no modules.dep (postinst makes it).
	if err := run(ctx, "/", busybox, "depmod", "-b", root, kver); err != nil {
		return nil, err
	}
	bz := filepath.Join(root, "boot", "vmlinuz-"+kver)
	if err := extractVmlinux(ctx, bz, k.Image); err != nil {
		// The bzImage boots too, only ~3.5 s slower under TCG.
		k.Image = bz
		if err := os.WriteFile(filepath.Join(dir, "image"), []byte(bz), 0o644); err != nil {
			return nil, err
		}
	}
	if err := buildInitrd(ctx, busybox, root, kver, k.Initrd); err != nil {
		return nil, err
	}
	if err := os.WriteFile(stamp, nil, 0o644); err != nil {
		return nil, err
	}
	return k, nil
}

// decompressModules turns every .ko.xz under root/lib/modules into a .ko.
func decompressModules(ctx context.Context, root string) error {
	var xz []string
	filepath.WalkDir(filepath.Join(root, "lib", "modules"), func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".ko.xz") {
			xz = append(xz, p)
		}
		return nil
	})
	for len(xz) > 0 {
		n := min(len(xz), 500)
		if err := run(ctx, "/", "xz", append([]string{"-d", "-T0"}, xz[:n]...)...); err != nil {
			return err
		}
		xz = xz[n:]
	}
	return nil
}

// loadKernel returns the cached kernel's paths (after PrepareKernel).
func (k *Kernel) image() string {
	if b, err := os.ReadFile(filepath.Join(filepath.Dir(k.Initrd), "image")); err == nil {
		return string(b)
	}
	return k.Image
}

func findBusybox() (string, error) {
	for _, p := range []string{"/bin/busybox", "/usr/bin/busybox"} {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", errors.New("busybox not found: install busybox-static")
}

// extractVmlinux pulls the XZ-compressed ELF out of the bzImage: qemu then
// boots it through the PVH entry point, skipping in-guest decompression.
func extractVmlinux(ctx context.Context, bz, dst string) error {
	b, err := os.ReadFile(bz)
	if err != nil {
		return err
	}
	// 6.1 compresses with XZ, 6.12 with zstd.
	var cmd *exec.Cmd
	if i := bytes.Index(b, []byte{0xfd, '7', 'z', 'X', 'Z', 0}); i >= 0 {
		cmd = exec.CommandContext(ctx, "xz", "-dc", "--single-stream")
		cmd.Stdin = bytes.NewReader(b[i:])
	} else if i := bytes.Index(b, []byte{0x28, 0xb5, 0x2f, 0xfd}); i >= 0 {
		// zstd -d stops at the end of the frame but complains about the
		// trailing bytes; the output is complete when the ELF check passes.
		cmd = exec.CommandContext(ctx, "sh", "-c", "zstd -dcq 2>/dev/null; true")
		cmd.Stdin = bytes.NewReader(b[i:])
	} else {
		return errors.New("no XZ or zstd payload in bzImage")
	}
	f, err := os.Create(dst + ".tmp")
	if err != nil {
		return err
	}
	cmd.Stdout = f
	err = cmd.Run()
	f.Close()
	if err != nil {
		os.Remove(dst + ".tmp")
		return fmt.Errorf("decompress: %w", err)
	}
	head := make([]byte, 4)
	if g, err := os.Open(dst + ".tmp"); err == nil {
		g.Read(head)
		g.Close()
	}
	if !bytes.Equal(head, []byte("\x7fELF")) {
		os.Remove(dst + ".tmp")
		return errors.New("extracted payload is not an ELF")
	}
	return os.Rename(dst+".tmp", dst)
}

// moduleClosure resolves names (with - or _) to .ko paths plus dependencies,
// from modules.dep.
func moduleClosure(modDir string, names []string) ([]string, error) {
	b, err := os.ReadFile(filepath.Join(modDir, "modules.dep"))
	if err != nil {
		return nil, err
	}
	deps := map[string][]string{}
	byName := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		deps[k] = strings.Fields(v)
		n := strings.TrimSuffix(filepath.Base(k), ".ko")
		n = strings.TrimSuffix(n, ".ko.xz")
		byName[strings.ReplaceAll(n, "-", "_")] = k
	}
	// Built-in modules (6.12 builds virtio_pci in) need no file.
	builtin := map[string]bool{}
	if b, err := os.ReadFile(filepath.Join(modDir, "modules.builtin")); err == nil {
		for _, l := range strings.Fields(string(b)) {
			builtin[strings.ReplaceAll(strings.TrimSuffix(filepath.Base(l), ".ko"), "-", "_")] = true
		}
	}
	seen := map[string]bool{}
	var out []string
	var add func(string)
	add = func(p string) {
		if seen[p] {
			return
		}
		seen[p] = true
		for _, d := range deps[p] {
			add(d)
		}
		out = append(out, p)
	}
	for _, n := range names {
		p, ok := byName[strings.ReplaceAll(n, "-", "_")]
		if !ok && builtin[strings.ReplaceAll(n, "-", "_")] {
			continue
		}
		if !ok {
			return nil, fmt.Errorf("module %s not in %s", n, modDir)
		}
		add(p)
	}
	return out, nil
}

func buildInitrd(ctx context.Context, busybox, root, kver, dst string) error {
	stage, err := os.MkdirTemp(filepath.Dir(dst), "initrd-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(stage)
	modDir := filepath.Join(root, "lib", "modules", kver)
	mods, err := moduleClosure(modDir, initrdModules)
	if err != nil {
		return err
	}
	for _, d := range []string{"bin", "proc", "sys", "dev", "lower", "host", "upper", "lib/modules/" + kver, "etc", "tmp"} {
		if err := os.MkdirAll(filepath.Join(stage, d), 0o755); err != nil {
			return err
		}
	}
	if err := copyFile(busybox, filepath.Join(stage, "bin", "busybox"), 0o755); err != nil {
		return err
	}
	for _, m := range mods {
		if err := os.MkdirAll(filepath.Join(stage, "lib/modules", kver, filepath.Dir(m)), 0o755); err != nil {
			return err
		}
		if err := copyFile(filepath.Join(modDir, m), filepath.Join(stage, "lib/modules", kver, m), 0o644); err != nil {
			return err
		}
	}
	for _, f := range []string{"modules.order", "modules.builtin", "modules.builtin.modinfo"} {
		copyFile(filepath.Join(modDir, f), filepath.Join(stage, "lib/modules", kver, f), 0o644)
	}
	if err := run(ctx, "/", busybox, "depmod", "-b", stage, kver); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(stage, "init"), []byte(initScript), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(stage, "etc", "inittab"), []byte(inittab), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(stage, "agent.sh"), []byte(agentScript), 0o755); err != nil {
		return err
	}
	sh := fmt.Sprintf("cd %s && find . | %s cpio -o -H newc 2>/dev/null | gzip -1 > %s.tmp", stage, busybox, dst)
	if err := run(ctx, "/", "sh", "-c", sh); err != nil {
		return err
	}
	return os.Rename(dst+".tmp", dst)
}

func copyFile(src, dst string, mode os.FileMode) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, mode)
}

// scriptsHash names the initramfs built from these scripts and modules.
func scriptsHash() string {
	h := sha256.Sum256([]byte(initScript + "\x00" + inittab + "\x00" + agentScript + "\x00" + strings.Join(initrdModules, ",")))
	return hex.EncodeToString(h[:4])
}

// initScript is the initramfs /init: mount the host root over 9p, load
// modules from the package's tree through it, stack an overlayfs with a
// tmpfs upper layer on top (so the guest may write anywhere without touching
// the host), put the guest's own /etc (the snapshot appended to the
// initramfs at boot, etc.go) over it, mount the kernel filesystems inside it, then hand over to
// busybox init (a real PID 1 that reaps orphans) which starts the agent.
const initScript = `#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() { echo "PALVM-FAIL $*"; poweroff -f; }
arg() { for w in $(cat /proc/cmdline); do case "$w" in "$1="*) echo "${w#*=}";; esac; done; }
echo /bin/modprobe > /proc/sys/kernel/modprobe
builtin() { grep -q "/$1.ko" /lib/modules/$(uname -r)/modules.builtin 2>/dev/null; }
for m in virtio_pci 9pnet_virtio 9p; do builtin $m || modprobe $m || fail modprobe $m; done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,ro,cache=loose hostroot /lower || fail mount 9p
mount --bind /lower$(arg pal.moddir) /lib/modules || fail modules
for m in $(arg pal.modules | tr , ' '); do builtin $m || modprobe $m || echo "PALVM-WARN modprobe $m"; done
mount -t tmpfs -o mode=755 upper /upper && mkdir -p /upper/u /upper/w || fail tmpfs
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w /host || fail overlay
[ -d /etcsnap ] || fail "no /etc snapshot in the initramfs"
mount --bind /etcsnap /host/etc || fail "bind the /etc snapshot"
mount -t proc proc /host/proc
mount -t sysfs sysfs /host/sys
mount -t devtmpfs devtmpfs /host/dev
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /host/dev/pts
mount -t tmpfs -o mode=1777 shm /host/dev/shm
mount -t cgroup2 cgroup2 /host/sys/fs/cgroup || fail cgroup2
mount -t securityfs securityfs /host/sys/kernel/security
mount -t bpf bpf /host/sys/fs/bpf
mount -t tmpfs -o mode=755 run /host/run
mount -t tmpfs -o mode=1777 tmp /host/tmp
hostname palvm
echo PALVM-BOOTED
exec /bin/busybox init
`

const inittab = `::sysinit:/bin/true
::once:/bin/sh /agent.sh
::ctrlaltdel:/bin/poweroff -f
`

// agentScript starts the agent in the overlay root; the guest powers off
// when it ends.
const agentScript = `#!/bin/busybox sh
export PATH=/bin
arg() { for w in $(cat /proc/cmdline); do case "$w" in "$1="*) echo "${w#*=}";; esac; done; }
port=
for n in /sys/class/virtio-ports/*/name; do [ "$(cat $n)" = pal.ctl ] && port=/dev/$(basename $(dirname $n)); done
[ -n "$port" ] || echo "PALVM-FAIL no control port"
# The overlay becomes the root of the mount namespace, as switch_root makes
# it, instead of a chroot under it: the kernel refuses unprivileged user
# namespaces to a chrooted process (and the attack suite creates them). This
# shell keeps the initramfs as its root, for poweroff.
cd /host && mount --move /host / || echo "PALVM-FAIL move the overlay to /"
chroot . /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
  $(arg pal.agent) vm agent --port "$port" $(cat /proc/cmdline)
echo "PALVM-EXIT $?"
sync
poweroff -f
`
