package packaging

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Clean roots are built once by mmdebstrap from Debian's mirror and reused
// from /var/cache/palisade/rootfs (extracting one takes seconds, building
// it ~25 s): Debian bookworm's "essential" set (dpkg, a shell, libc,
// base-passwd), and the same with rpm as the package manager.
const rootfsDir = "/var/cache/palisade/rootfs"

const (
	testVersion = "9.8.7~test.1"
	oldVersion  = "9.8.6~test.1" // the upgrade test's previous version
)

// pkgs are the packages of testVersion and those of oldVersion.
type pkgs struct {
	deb, dbgsym, rpm, debuginfo string
	oldDeb, oldRPM              string
}

var (
	buildOnce      sync.Once
	built          pkgs
	buildErr       error
	buildDir       string
	errBuildFailed = errors.New("packages not built (see the first test's failure)")
)

func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// build builds the stamped binaries, the SPANK plugin and the packages of
// both versions, once per run of the test binary.
func build(t *testing.T) pkgs {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the binary and the packages")
	}
	buildOnce.Do(func() {
		buildErr = errBuildFailed
		built = buildPackages(t)
		buildErr = nil
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return built
}

func buildPackages(t *testing.T) pkgs {
	dir, err := os.MkdirTemp("", "palpkgtest")
	if err != nil {
		t.Fatal(err)
	}
	buildDir = dir
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	so := filepath.Join(dir, "pal_uvn_spank.so")
	if out, err := exec.Command("make", "-s", "-C", filepath.Join(root, "packaging/spank"),
		"SRC="+filepath.Join(root, "internal/dataplane/uvn/spank/c/pal_uvn_spank.c"), "OUT="+so).CombinedOutput(); err != nil {
		t.Fatalf("SPANK plugin (packaging/spank/Makefile): %v\n%s", err, out)
	}
	var p pkgs
	for _, v := range []string{oldVersion, testVersion} {
		vdir := filepath.Join(dir, v)
		bin := filepath.Join(vdir, "palisade")
		ld := "-B gobuildid -X github.com/palisade-hpc/palisade/internal/version.version=" + v +
			" -X github.com/palisade-hpc/palisade/internal/version.commit=0123456789abcdef0123456789abcdef01234567" +
			" -X github.com/palisade-hpc/palisade/internal/version.date=2026-01-02T03:04:05Z"
		cmd := exec.Command("go", "build", "-trimpath", "-ldflags", ld, "-o", bin, "./cmd/palisade")
		cmd.Dir, cmd.Env = root, append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build: %v\n%s", err, out)
		}
		date := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
		out, err := Build(Options{Root: root, Binary: bin, SpankSO: so, Version: v, Date: date, OutDir: vdir, NoDebug: v == oldVersion})
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range out {
			b := filepath.Base(f)
			switch {
			case v == oldVersion && strings.HasSuffix(b, ".deb"):
				p.oldDeb = f
			case v == oldVersion && strings.HasSuffix(b, ".rpm"):
				p.oldRPM = f
			case strings.HasPrefix(b, "palisade-dbgsym_"):
				p.dbgsym = f
			case strings.HasPrefix(b, "palisade-debuginfo-"):
				p.debuginfo = f
			case strings.HasPrefix(b, "palisade_"):
				p.deb = f
			case strings.HasPrefix(b, "palisade-"):
				p.rpm = f
			}
		}
	}
	if p.deb == "" || p.dbgsym == "" || p.rpm == "" || p.debuginfo == "" || p.oldDeb == "" || p.oldRPM == "" {
		t.Fatalf("packages: %+v", p)
	}
	return p
}

// cleanRoot extracts a cached clean Debian root (with the packages
// include, e.g. rpm) into a temporary directory, building the cache first
// if needed (serialised by a lock: several test runs share the machine).
func cleanRoot(t *testing.T, include ...string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (chroot)")
	}
	name := "bookworm-essential"
	if len(include) > 0 {
		name = "bookworm-" + strings.Join(include, "-")
	}
	cache := filepath.Join(rootfsDir, name+".tar")
	if err := os.MkdirAll(rootfsDir, 0o755); err != nil {
		t.Fatal(err)
	}
	lock, err := os.OpenFile(cache+".lock", os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(cache); err != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
		defer cancel()
		tmp := cache + ".tmp.tar"
		args := []string{"--quiet", "--variant=essential", "--mode=root"}
		if len(include) > 0 {
			args = append(args, "--include="+strings.Join(include, ","))
		}
		out, err := exec.CommandContext(ctx, "mmdebstrap", append(args, "bookworm", tmp)...).CombinedOutput()
		if err != nil {
			os.Remove(tmp)
			t.Fatalf("mmdebstrap (Debian package mmdebstrap, .ci/deps): %v\n%s", err, out)
		}
		if err := os.Rename(tmp, cache); err != nil {
			t.Fatal(err)
		}
	}
	syscall.Flock(int(lock.Fd()), syscall.LOCK_UN)
	dir := t.TempDir()
	if out, err := exec.Command("tar", "-C", dir, "-xf", cache).CombinedOutput(); err != nil {
		t.Fatalf("extract %s: %v\n%s", cache, err, out)
	}
	for _, d := range []string{"proc", "sys", "tmp"} {
		os.MkdirAll(filepath.Join(dir, d), 0o755)
	}
	return dir
}

// inRoot runs argv chrooted into root, in a new network namespace: the
// package's maintainer scripts (prerm runs `palisade agent --uninstall`)
// must never touch the host's network namespace.
func inRoot(root string, argv ...string) (string, error) {
	cmd := exec.Command("unshare", append([]string{"--net", "--", "chroot", root}, argv...)...)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "DEBIAN_FRONTEND=noninteractive"}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// inRootSys is inRoot with /proc and /sys as a node has them (status and
// doctor read the kernel), in a private mount namespace with a bpffs of
// its own: nothing pinned by anything else on the host is seen, and
// nothing can be pinned on the host's.
func inRootSys(root string, argv ...string) (string, int) {
	const script = `set -e; R=$1; shift
mount -t proc proc "$R/proc"; mount --rbind /sys "$R/sys"; mount -t bpf bpf "$R/sys/fs/bpf"
exec chroot "$R" "$@"`
	cmd := exec.Command("unshare", append([]string{"--net", "--mount", "--propagation", "private", "--fork", "--", "sh", "-c", script, "sh", root}, argv...)...)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"}
	out, _ := cmd.CombinedOutput()
	return string(out), cmd.ProcessState.ExitCode()
}

// snapshot lists every path in root but the package managers' own
// databases and logs and the pseudo file systems.
func snapshot(t *testing.T, root string) map[string]bool {
	t.Helper()
	skip := regexp.MustCompile(`^(proc|sys|dev|run|tmp)(/|$)|^var/lib/(dpkg|rpm)/|^var/log/(dpkg|alternatives)\.log$|^var/cache/(debconf|ldconfig)/`)
	paths := map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			return nil
		}
		if skip.MatchString(rel) {
			if d.IsDir() && !strings.Contains(rel, "/") {
				return filepath.SkipDir
			}
			return nil
		}
		paths[rel] = true
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return paths
}

// leftOver: paths in after but not in before, sorted; and those gone.
func leftOver(before, after map[string]bool) (added, removed []string) {
	for p := range after {
		if !before[p] {
			added = append(added, p)
		}
	}
	for p := range before {
		if !after[p] {
			removed = append(removed, p)
		}
	}
	slices.Sort(added)
	slices.Sort(removed)
	return added, removed
}

// checkInstalled runs what an administrator runs first on a freshly
// installed node: the version, config check (of the shipped file and of a
// broken one), status and doctor; and checks the binary is stripped with
// its build ID kept.
func checkInstalled(t *testing.T, root string) {
	t.Helper()
	out, err := inRoot(root, "palisade", "version")
	if err != nil || !strings.Contains(out, "version:     "+testVersion+"\n") ||
		!strings.Contains(out, "commit:      0123456789abcdef0123456789abcdef01234567\n") ||
		!regexp.MustCompile(`cilium/ebpf: v\d+\.\d+\.\d+`).MatchString(out) {
		t.Errorf("palisade version: %v\n%s", err, out)
	}
	out, err = inRoot(root, "/usr/bin/palisade", "--version")
	if err != nil || !strings.HasPrefix(out, "palisade "+testVersion+" (commit 0123456789ab, built 2026-01-02T03:04:05Z") {
		t.Errorf("palisade --version: %v\n%s", err, out)
	}
	// The shipped default configuration is valid as it stands (and with
	// the site's edit the upgrade kept).
	out, err = inRoot(root, "palisade", "config", "check")
	if err != nil || !strings.Contains(out, "# /etc/palisade/palisade.toml: OK") {
		t.Errorf("palisade config check (shipped file): %v\n%s", err, out)
	}
	// ... and config check refuses a broken one, naming the line.
	conf := filepath.Join(root, "etc/palisade/palisade.toml")
	orig := must(os.ReadFile(conf))
	os.WriteFile(conf, []byte(strings.Replace(string(orig), "#system_port_max = 1023", "system_port_max = 70000", 1)), 0o644)
	out, err = inRoot(root, "palisade", "config", "check")
	if err == nil || !regexp.MustCompile(`palisade\.toml:\d+: policy\.system_port_max: port 70000 out of range`).MatchString(out) {
		t.Errorf("config check of a broken file: %v\n%s", err, out)
	}
	os.WriteFile(conf, orig, 0o644)

	// Installed, not started: status says so on its first line (exit 2),
	// doctor probes this kernel with the installed binary.
	out, code := inRootSys(root, "palisade", "status")
	if code != 2 || !strings.HasPrefix(out, "palisade:    NOT ENFORCING") {
		t.Errorf("palisade status on an installed, unstarted node: exit %d\n%s", code, out)
	}
	out, code = inRootSys(root, "palisade", "doctor")
	if !strings.Contains(out, "(userwall needs >= 6.1)") || !strings.Contains(out, "bpf LSM active") ||
		(code == 0) != strings.Contains(out, "userwall can run on this kernel.") || code > 1 {
		t.Errorf("palisade doctor: exit %d\n%s", code, out)
	}

	// Stripped (no symbol table, no DWARF), with the GNU build ID that
	// finds its debug file.
	f, err := elf.Open(filepath.Join(root, "usr/bin/palisade"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, s := range []string{".symtab", ".debug_info", ".zdebug_info"} {
		if f.Section(s) != nil {
			t.Errorf("/usr/bin/palisade is not stripped: %s", s)
		}
	}
	if f.Section(".note.gnu.build-id") == nil {
		t.Error("/usr/bin/palisade has no GNU build ID")
	}
}

// buildID reads the installed binary's GNU build ID (readelf -n).
func buildID(t *testing.T, path string) string {
	t.Helper()
	out, err := exec.Command("readelf", "-n", path).CombinedOutput()
	m := regexp.MustCompile(`Build ID: ([0-9a-f]{16,})`).FindSubmatch(out)
	if err != nil || m == nil {
		t.Fatalf("readelf -n %s: %v\n%s", path, err, out)
	}
	return string(m[1])
}

// useNode leaves on the node what running Palisade leaves: a cluster key,
// an event log, the egress gateway's state, and a policy file the
// administrator added.
func useNode(t *testing.T, root string) {
	t.Helper()
	if out, err := inRoot(root, "palisade", "key", "generate", "/etc/palisade/cluster.key"); err != nil {
		t.Fatalf("key generate: %v\n%s", err, out)
	}
	for p, body := range map[string]string{
		"var/log/palisade/userwall-events.jsonl": `{"verdict":"deny"}` + "\n",
		"var/lib/palisade/egress/leases.json":    "{}\n",
		"etc/palisade/policy.d/site.toml":        "# the site's rules\n",
	} {
		os.MkdirAll(filepath.Dir(filepath.Join(root, p)), 0o755)
		if err := os.WriteFile(filepath.Join(root, p), []byte(body), 0o640); err != nil {
			t.Fatal(err)
		}
	}
}

// TestDebInstallsInCleanRoot installs the previous version's .deb into a
// clean Debian root with dpkg (maintainer scripts included), edits its
// configuration as a site would, upgrades to this version, runs the
// installed binary (config check, status, doctor), checks that every path
// the package's files name exists, and purges: nothing may remain but the
// file the administrator added.
func TestDebInstallsInCleanRoot(t *testing.T) {
	p := build(t)
	root := cleanRoot(t)
	before := snapshot(t, root)
	for _, f := range []string{p.oldDeb, p.deb, p.dbgsym} {
		if err := os.WriteFile(filepath.Join(root, "tmp", filepath.Base(f)), must(os.ReadFile(f)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	inTmp := func(f string) string { return "/tmp/" + filepath.Base(f) }
	if out, err := inRoot(root, "dpkg", "-i", inTmp(p.oldDeb)); err != nil {
		t.Fatalf("dpkg -i (previous version): %v\n%s", err, out)
	}
	conf := filepath.Join(root, "etc/palisade/palisade.toml")
	edited := append(must(os.ReadFile(conf)), "\n# site: edited before the upgrade\n"...)
	os.WriteFile(conf, edited, 0o644)
	if out, err := inRoot(root, "dpkg", "-i", inTmp(p.deb), inTmp(p.dbgsym)); err != nil {
		t.Fatalf("dpkg -i (upgrade): %v\n%s", err, out)
	}
	out, err := inRoot(root, "dpkg-query", "-W", "-f=${Status} ${Version}", "palisade")
	if err != nil || out != "install ok installed "+testVersion+"-1" {
		t.Fatalf("dpkg-query: %q %v", out, err)
	}
	if b, _ := os.ReadFile(conf); !bytes.Equal(b, edited) {
		t.Error("the upgrade did not keep the site's palisade.toml")
	}
	checkInstalled(t, root)
	id := buildID(t, filepath.Join(root, "usr/bin/palisade"))
	if _, err := os.Stat(filepath.Join(root, DebugPath(id))); err != nil {
		t.Errorf("palisade-dbgsym lacks the binary's debug file %s", DebugPath(id))
	}

	// One binary path everywhere: the units run the installed binary, and
	// their Documentation= man pages are installed.
	units, _ := filepath.Glob(filepath.Join(root, "usr/lib/systemd/system/palisade-*.service"))
	if len(units) != 3 {
		t.Fatalf("units: %v", units)
	}
	for _, u := range units {
		checkUnit(t, root, u)
	}
	for _, f := range []string{SpankSOPath, "/usr/share/palisade/spank/pal_uvn_spank.c",
		"/usr/share/palisade/spank/Makefile", "/etc/logrotate.d/palisade", "/usr/share/bash-completion/completions/palisade",
		"/usr/share/zsh/vendor-completions/_palisade", "/usr/share/fish/vendor_completions.d/palisade.fish",
		"/usr/share/doc/palisade/deploy.md", "/usr/share/doc/palisade/users.md", "/usr/share/man/man1/palisade-explain.1.gz",
		"/usr/share/doc/palisade/copyright", "/usr/share/doc/palisade/changelog.Debian.gz", "/usr/share/lintian/overrides/palisade"} {
		if _, err := os.Stat(filepath.Join(root, f)); err != nil {
			t.Errorf("installed package lacks %s", f)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(root, "usr/share/doc/palisade/copyright")); !bytes.HasPrefix(b, []byte("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n")) ||
		!bytes.Contains(b, []byte("\nFiles: github.com/cilium/ebpf/*\n")) {
		t.Errorf("copyright file:\n%.400s", b)
	}
	out, _ = inRoot(root, "cat", "/var/lib/dpkg/info/palisade.conffiles")
	if !strings.Contains(out, "/etc/palisade/palisade.toml\n") || !strings.Contains(out, "/etc/logrotate.d/palisade\n") {
		t.Errorf("palisade.toml or the logrotate file is not a conffile: %q", out)
	}
	// The generated completion script loads in bash and completes commands.
	out, err = inRoot(root, "bash", "-c", `. /usr/share/bash-completion/completions/palisade && complete -p palisade`)
	if err != nil || !strings.Contains(out, "palisade") {
		t.Errorf("bash completion: %v\n%s", err, out)
	}

	// Removal runs prerm (services off, data plane uninstalled — here in
	// the chroot's own empty network namespace) and keeps the conffile.
	useNode(t, root)
	if out, err := inRoot(root, "dpkg", "-r", "palisade-dbgsym", "palisade"); err != nil {
		t.Fatalf("dpkg -r: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(root, "usr/bin/palisade")); err == nil {
		t.Error("dpkg -r left /usr/bin/palisade")
	}
	if _, err := os.Stat(conf); err != nil {
		t.Error("dpkg -r removed the conffile")
	}
	// Purge removes the configuration, the key, logs and state: only the
	// administrator's own file stays (docs/deploy.md, Removing).
	if out, err := inRoot(root, "dpkg", "--purge", "palisade"); err != nil {
		t.Fatalf("dpkg --purge: %v\n%s", err, out)
	}
	added, removed := leftOver(before, snapshot(t, root))
	if want := []string{"etc/palisade", "etc/palisade/policy.d", "etc/palisade/policy.d/site.toml"}; !slices.Equal(added, want) || len(removed) > 0 {
		t.Errorf("after purge: left %q (want %q), removed %q", added, want, removed)
	}
}

// checkUnit: ExecStart/ExecReload run /usr/bin/palisade, every man:
// Documentation page and every file: document is installed.
func checkUnit(t *testing.T, root, unit string) {
	t.Helper()
	f, err := os.Open(unit)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	manRe := regexp.MustCompile(`^man:([a-z-]+)\((\d)\)$`)
	sc := bufio.NewScanner(f)
	notify, exec := false, false
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), "=")
		if !ok {
			continue
		}
		switch k {
		case "Type":
			notify = v == "notify"
		case "ExecStart", "ExecReload":
			exec = true
			if !strings.HasPrefix(v, BinPath+" ") {
				t.Errorf("%s: %s=%s does not run %s", filepath.Base(unit), k, v, BinPath)
			}
		case "Documentation":
			for _, d := range strings.Fields(v) {
				if m := manRe.FindStringSubmatch(d); m != nil {
					d = "file:/usr/share/man/man" + m[2] + "/" + m[1] + "." + m[2] + ".gz"
				}
				p, ok := strings.CutPrefix(d, "file:")
				if !ok {
					t.Errorf("%s: Documentation %s: want man: or file:", filepath.Base(unit), d)
					continue
				}
				if _, err := os.Stat(filepath.Join(root, p)); err != nil {
					t.Errorf("%s: Documentation %s is not installed", filepath.Base(unit), d)
				}
			}
		}
	}
	if !notify || !exec {
		t.Errorf("%s: want Type=notify and an ExecStart", filepath.Base(unit))
	}
}

// TestRPMContents checks the .rpm with rpm itself: files, conffiles,
// documentation, licence, changelog, scripts; and that the Debian-built
// SPANK .so is not in it.
func TestRPMContents(t *testing.T) {
	rpm := build(t).rpm
	if _, err := exec.LookPath("rpm"); err != nil {
		t.Fatal("rpm not installed (Debian package rpm, .ci/deps)")
	}
	q := func(args ...string) string {
		out, err := exec.Command("rpm", append(args, rpm)...).CombinedOutput()
		if err != nil {
			t.Fatalf("rpm %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	files := strings.Split(strings.TrimSpace(q("-qlp")), "\n")
	for _, want := range []string{BinPath, ConfigPath, "/usr/lib/systemd/system/palisade-agent.service",
		"/usr/lib/systemd/system/palisade-ident.service", "/usr/lib/systemd/system/palisade-gateway.service",
		"/etc/logrotate.d/palisade", "/usr/share/palisade/spank/pal_uvn_spank.c", "/usr/share/palisade/spank/Makefile",
		"/usr/share/man/man1/palisade-agent.1.gz", "/usr/share/bash-completion/completions/palisade", "/usr/share/doc/palisade/deploy.md",
		"/usr/share/licenses/palisade/LICENSE", "/usr/share/licenses/palisade/copyright"} {
		if !slices.Contains(files, want) {
			t.Errorf("rpm -qlp lacks %s", want)
		}
	}
	if slices.Contains(files, SpankSOPath) {
		t.Errorf("rpm carries the SPANK plugin built for Debian's Slurm")
	}
	if cf := q("-qcp"); !strings.Contains(cf, ConfigPath+"\n") || !strings.Contains(cf, "/etc/logrotate.d/palisade") {
		t.Errorf("rpm -qcp: %q", cf)
	}
	if d := q("-qdp"); !strings.Contains(d, "/usr/share/man/man1/palisade.1.gz\n") || !strings.Contains(d, "/usr/share/doc/palisade/deploy.md\n") {
		t.Errorf("rpm -qdp (documentation): %q", d)
	}
	if l := q("-qp", "--qf", "%{LICENSE}"); !strings.HasPrefix(l, "Apache-2.0 AND GPL-2.0-only AND MIT") {
		t.Errorf("rpm License %q", l)
	}
	if c := q("-qp", "--changelog"); !strings.Contains(c, "Palisade developers <") || !strings.Contains(c, " - "+testVersion+"-1\n") {
		t.Errorf("rpm --changelog:\n%s", c)
	}
	// The agent is restarted on upgrade only if the new version accepts the
	// configuration and its policy tests (postinst: agent=palisade-agent.service).
	if s := q("-qp", "--scripts"); !strings.Contains(s, "agent=palisade-agent.service") || !strings.Contains(s, "try-restart $agent") ||
		!strings.Contains(s, "agent --uninstall") || strings.Contains(s, "rm -") {
		t.Errorf("rpm scripts:\n%s", s)
	}
	if v := q("-qp", "--qf", "%{VERSION}-%{RELEASE}"); v != testVersion+"-1" {
		t.Errorf("rpm version %q", v)
	}
}

// TestRPMInstallsInRoot installs the previous version's .rpm into a clean
// root whose package manager is rpm, upgrades it to this version (with the
// site's edit of the configuration), runs config check, status and doctor,
// verifies the files (rpm -V) and erases it: what remains is what rpm
// always keeps (the changed configuration as .rpmsave) and the data the
// node made, as docs/deploy.md says. No RHEL-family root can be had here
// (Debian's is the only distribution mirror reachable), so the root is
// Debian's with Debian's rpm 4.18; its rpm database starts empty, so
// dependencies are checked here against the root's files and rpm's own
// capabilities, and rpm installs with --nodeps.
func TestRPMInstallsInRoot(t *testing.T) {
	p := build(t)
	root := cleanRoot(t, "rpm")
	rpm := func(args ...string) string {
		t.Helper()
		out, err := inRoot(root, append([]string{"rpm", "--force-debian"}, args...)...)
		if err != nil {
			t.Fatalf("rpm %v: %v\n%s", args, err, out)
		}
		return out
	}
	if out, err := inRoot(root, "rpm", "--initdb"); err != nil {
		t.Fatalf("rpm --initdb: %v\n%s", err, out)
	}
	before := snapshot(t, root)
	for _, f := range []string{p.oldRPM, p.rpm, p.debuginfo} {
		if err := os.WriteFile(filepath.Join(root, "tmp", filepath.Base(f)), must(os.ReadFile(f)), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command("rpm", "-qpR", f).CombinedOutput()
		if err != nil {
			t.Fatalf("rpm -qpR %s: %v\n%s", f, err, out)
		}
		for _, req := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			switch {
			case req == "": // none
			case strings.HasPrefix(req, "rpmlib("):
			case strings.HasPrefix(req, "/"):
				if _, err := os.Stat(filepath.Join(root, req)); err != nil {
					t.Errorf("%s requires %s: not in the root", filepath.Base(f), req)
				}
			case strings.HasPrefix(req, "palisade = ") && strings.Contains(f, "debuginfo"):
			default:
				t.Errorf("%s requires %q: not checked here", filepath.Base(f), req)
			}
		}
	}
	inTmp := func(f string) string { return "/tmp/" + filepath.Base(f) }
	rpm("-i", "--nodeps", inTmp(p.oldRPM))
	conf := filepath.Join(root, "etc/palisade/palisade.toml")
	edited := append(must(os.ReadFile(conf)), "\n# site: edited before the upgrade\n"...)
	os.WriteFile(conf, edited, 0o644)
	rpm("-U", "--nodeps", inTmp(p.rpm), inTmp(p.debuginfo))
	if v := rpm("-q", "palisade"); v != "palisade-"+testVersion+"-1.x86_64\n" {
		t.Fatalf("rpm -q palisade: %q", v)
	}
	if b, _ := os.ReadFile(conf); !bytes.Equal(b, edited) {
		t.Error("the upgrade did not keep the site's palisade.toml")
	}
	checkInstalled(t, root)
	id := buildID(t, filepath.Join(root, "usr/bin/palisade"))
	if _, err := os.Stat(filepath.Join(root, DebugPath(id))); err != nil {
		t.Errorf("palisade-debuginfo lacks the binary's debug file %s", DebugPath(id))
	}
	// Every file as the package has it, but the edited configuration.
	out, err := inRoot(root, "rpm", "--force-debian", "-V", "palisade", "palisade-debuginfo")
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if line != "" && !strings.HasSuffix(line, " c /etc/palisade/palisade.toml") {
			t.Errorf("rpm -V: %v\n%s", err, out)
			break
		}
	}

	useNode(t, root)
	rpm("-e", "palisade-debuginfo", "palisade")
	added, removed := leftOver(before, snapshot(t, root))
	// Directories a RHEL system's own packages own (filesystem, zsh,
	// fish): in this root no package does, so they stay here.
	added = slices.DeleteFunc(added, func(p string) bool {
		return slices.Contains([]string{"usr/lib/debug", "usr/lib/debug/.build-id", "usr/share/licenses",
			"usr/share/zsh", "usr/share/zsh/site-functions", "usr/share/fish", "usr/share/fish/vendor_completions.d"}, p)
	})
	want := []string{"etc/palisade", "etc/palisade/cluster.key", "etc/palisade/palisade.toml.rpmsave", "etc/palisade/policy.d",
		"etc/palisade/policy.d/site.toml", "var/lib/palisade", "var/lib/palisade/egress", "var/lib/palisade/egress/leases.json",
		"var/log/palisade", "var/log/palisade/userwall-events.jsonl"}
	if !slices.Equal(added, want) || len(removed) > 0 {
		t.Errorf("after rpm -e: left %q\n(want %q), removed %q", added, want, removed)
	}
}

// TestUnitsVerify loads the installed units with systemd's own loader
// (systemd-analyze verify: every directive, the capability sets, the
// executables, and the start transaction of each unit with its
// dependencies) in a clean root with Debian's systemd and slurmd, the
// optional slurmd drop-in installed as docs/deploy.md says. A drop-in that
// orders slurmd before the agent must be refused as a cycle (the control:
// verify does check ordering). systemd itself does not run here: its units
// are not started as PID 1 would (see the report of issue 22).
func TestUnitsVerify(t *testing.T) {
	p := build(t)
	if _, err := exec.LookPath("systemd-analyze"); err != nil {
		t.Fatal("systemd-analyze not installed (Debian package systemd)")
	}
	root := cleanRoot(t, "systemd", "slurmd", "procps")
	os.WriteFile(filepath.Join(root, "tmp", filepath.Base(p.deb)), must(os.ReadFile(p.deb)), 0o644)
	if out, err := inRoot(root, "dpkg", "-i", "/tmp/"+filepath.Base(p.deb)); err != nil {
		t.Fatalf("dpkg -i: %v\n%s", err, out)
	}
	dropin := filepath.Join(root, "etc/systemd/system/slurmd.service.d")
	os.MkdirAll(dropin, 0o755)
	if err := os.WriteFile(filepath.Join(dropin, "palisade.conf"), must(os.ReadFile(filepath.Join(root, "usr/share/palisade/systemd/slurmd-palisade.conf"))), 0o644); err != nil {
		t.Fatal(err)
	}
	verify := func() (string, error) {
		out, err := exec.Command("systemd-analyze", "verify", "--root="+root, "--man=no",
			"palisade-agent.service", "palisade-ident.service", "palisade-gateway.service", "slurmd.service").CombinedOutput()
		return string(out), err
	}
	if out, err := verify(); err != nil || out != "" {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
	os.WriteFile(filepath.Join(dropin, "zz-cycle.conf"), []byte("[Unit]\nBefore=palisade-agent.service\n"), 0o644)
	if out, err := verify(); !strings.Contains(out, "Found ordering cycle") {
		t.Errorf("systemd-analyze verify of slurmd ordered before the agent (control): %v\n%s", err, out)
	}
}

// TestLintian: lintian finds nothing in the .debs but what
// packaging/lintian/palisade overrides, each with its reason.
func TestLintian(t *testing.T) {
	p := build(t)
	if _, err := exec.LookPath("lintian"); err != nil {
		t.Fatal("lintian not installed (Debian package lintian, .ci/deps)")
	}
	out, _ := exec.Command("lintian", "--tag-display-limit", "0", p.deb, p.dbgsym).CombinedOutput()
	for _, line := range strings.Split(string(out), "\n") {
		if regexp.MustCompile(`^[EWX]: `).MatchString(line) || strings.Contains(line, "override") {
			t.Errorf("lintian: %s", line)
		}
	}
	if t.Failed() {
		t.Logf("lintian:\n%s", out)
	}
}

// TestRpmlint: rpmlint finds nothing in the .rpms but what
// packaging/rpmlint.toml filters, each with its reason.
func TestRpmlint(t *testing.T) {
	p := build(t)
	if _, err := exec.LookPath("rpmlint"); err != nil {
		t.Fatal("rpmlint not installed (Debian package rpmlint, .ci/deps)")
	}
	// rpmlint unpacks with "rpm2cpio | cpio -id"; nfpm's payload names are
	// absolute, which GNU cpio would write to / itself: a cpio first in
	// PATH that keeps them inside rpmlint's directory.
	wrap := t.TempDir()
	os.WriteFile(filepath.Join(wrap, "cpio"), []byte("#!/bin/sh\nexec /usr/bin/cpio --no-absolute-filenames \"$@\"\n"), 0o755)
	cmd := exec.Command("rpmlint", "-c", must(filepath.Abs("rpmlint.toml")), p.rpm, p.debuginfo)
	cmd.Dir = t.TempDir()
	cmd.Env = append(os.Environ(), "PATH="+wrap+":"+os.Getenv("PATH"), "TMPDIR="+cmd.Dir)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), " 0 errors, 0 warnings,") {
		t.Errorf("rpmlint: %v\n%s", err, out)
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestOneBinaryPath: every unit, PAM line, plugstack.conf line and document
// names the binary where the package installs it.
func TestOneBinaryPath(t *testing.T) {
	re := regexp.MustCompile(`/usr/(local/)?s?bin/palisade\b`)
	var files []string
	for _, g := range []string{"../README.md", "../docs/*.md", "../packaging/*/*", "../packaging/*.toml", "../internal/dataplane/uvn/spank/c/*.c", "../internal/cli/*.go"} {
		m, _ := filepath.Glob(g)
		files = append(files, m...)
	}
	if len(files) < 10 {
		t.Fatalf("found only %v", files)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // directories
		}
		for i, line := range strings.Split(string(b), "\n") {
			for _, m := range re.FindAllString(line, -1) {
				if m != BinPath {
					t.Errorf("%s:%d: %s, want %s", f, i+1, m, BinPath)
				}
			}
		}
	}
}
