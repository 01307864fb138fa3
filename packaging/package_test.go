package packaging

import (
	"bufio"
	"context"
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

// rootfsCache is a clean Debian bookworm (the "essential" package set:
// dpkg, a shell, libc, base-passwd), built once by mmdebstrap from the
// Debian mirror and reused: extracting it takes seconds, building it ~25 s.
const rootfsCache = "/var/cache/palisade/rootfs/bookworm-essential.tar"

const testVersion = "9.8.7~test.1"

var (
	buildOnce      sync.Once
	builtDeb       string
	builtRPM       string
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

// build builds the stamped binary, the SPANK plugin and both packages, once
// per run of the test binary.
func build(t *testing.T) (deb, rpm string) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the binary and the packages")
	}
	buildOnce.Do(func() {
		buildErr = errBuildFailed
		builtDeb, builtRPM = buildPackages(t)
		buildErr = nil
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return builtDeb, builtRPM
}

func buildPackages(t *testing.T) (deb, rpm string) {
	dir, err := os.MkdirTemp("", "palpkgtest")
	if err != nil {
		t.Fatal(err)
	}
	buildDir = dir
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "palisade")
	ld := "-X github.com/palisade-hpc/palisade/internal/version.version=" + testVersion +
		" -X github.com/palisade-hpc/palisade/internal/version.commit=0123456789abcdef0123456789abcdef01234567" +
		" -X github.com/palisade-hpc/palisade/internal/version.date=2026-01-02T03:04:05Z"
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", ld, "-o", bin, "./cmd/palisade")
	cmd.Dir, cmd.Env = root, append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	so := filepath.Join(dir, "pal_uvn_spank.so")
	if out, err := exec.Command("make", "-s", "-C", filepath.Join(root, "packaging/spank"),
		"SRC="+filepath.Join(root, "internal/dataplane/uvn/spank/c/pal_uvn_spank.c"), "OUT="+so).CombinedOutput(); err != nil {
		t.Fatalf("SPANK plugin (packaging/spank/Makefile): %v\n%s", err, out)
	}
	date := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	pkgs, err := Build(Options{Root: root, Binary: bin, SpankSO: so, Version: testVersion, Date: date, OutDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pkgs {
		switch filepath.Ext(p) {
		case ".deb":
			deb = p
		case ".rpm":
			rpm = p
		}
	}
	if deb == "" || rpm == "" {
		t.Fatalf("packages: %v", pkgs)
	}
	return deb, rpm
}

// cleanRoot extracts the cached clean Debian root into a temporary
// directory, building the cache first if needed (serialised by a lock:
// several test runs share the machine).
func cleanRoot(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (chroot)")
	}
	if err := os.MkdirAll(filepath.Dir(rootfsCache), 0o755); err != nil {
		t.Fatal(err)
	}
	lock, err := os.OpenFile(rootfsCache+".lock", os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(rootfsCache); err != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		tmp := rootfsCache + ".tmp.tar"
		out, err := exec.CommandContext(ctx, "mmdebstrap", "--quiet", "--variant=essential", "--mode=root",
			"bookworm", tmp).CombinedOutput()
		if err != nil {
			os.Remove(tmp)
			t.Fatalf("mmdebstrap (Debian package mmdebstrap, .ci/deps): %v\n%s", err, out)
		}
		if err := os.Rename(tmp, rootfsCache); err != nil {
			t.Fatal(err)
		}
	}
	syscall.Flock(int(lock.Fd()), syscall.LOCK_UN)
	dir := t.TempDir()
	if out, err := exec.Command("tar", "-C", dir, "-xf", rootfsCache).CombinedOutput(); err != nil {
		t.Fatalf("extract %s: %v\n%s", rootfsCache, err, out)
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

// TestDebInstallsInCleanRoot installs the .deb into a clean Debian root with
// dpkg (maintainer scripts included), runs the installed binary there, and
// checks that every path the package's files name exists in it.
func TestDebInstallsInCleanRoot(t *testing.T) {
	deb, _ := build(t)
	root := cleanRoot(t)
	if err := os.WriteFile(filepath.Join(root, "tmp/palisade.deb"), must(os.ReadFile(deb)), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := inRoot(root, "dpkg", "-i", "/tmp/palisade.deb"); err != nil {
		t.Fatalf("dpkg -i: %v\n%s", err, out)
	}
	out, err := inRoot(root, "dpkg-query", "-W", "-f=${Status} ${Version}", "palisade")
	if err != nil || out != "install ok installed "+testVersion+"-1" {
		t.Fatalf("dpkg-query: %q %v", out, err)
	}

	out, err = inRoot(root, "palisade", "version")
	if err != nil || !strings.Contains(out, "version:     "+testVersion+"\n") ||
		!strings.Contains(out, "commit:      0123456789abcdef0123456789abcdef01234567\n") ||
		!regexp.MustCompile(`cilium/ebpf: v\d+\.\d+\.\d+`).MatchString(out) {
		t.Errorf("palisade version: %v\n%s", err, out)
	}
	out, err = inRoot(root, "/usr/bin/palisade", "--version")
	if err != nil || !strings.HasPrefix(out, "palisade "+testVersion+" (commit 0123456789ab, built 2026-01-02T03:04:05Z") {
		t.Errorf("palisade --version: %v\n%s", err, out)
	}
	// The shipped default configuration is valid as it stands.
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

	// One binary path everywhere: the units run the installed binary, and
	// their Documentation= man pages are installed.
	units, _ := filepath.Glob(filepath.Join(root, "usr/lib/systemd/system/palisade-*.service"))
	if len(units) != 3 {
		t.Fatalf("units: %v", units)
	}
	for _, u := range units {
		checkUnit(t, root, u)
	}
	for _, p := range []string{"usr/lib/palisade/pal_uvn_spank.so", "usr/share/palisade/spank/pal_uvn_spank.c",
		"usr/share/palisade/spank/Makefile", "etc/logrotate.d/palisade", "usr/share/bash-completion/completions/palisade",
		"usr/share/zsh/vendor-completions/_palisade", "usr/share/fish/vendor_completions.d/palisade.fish",
		"usr/share/doc/palisade/deploy.md", "usr/share/doc/palisade/users.md", "usr/share/man/man1/palisade-explain.1"} {
		if _, err := os.Stat(filepath.Join(root, p)); err != nil {
			t.Errorf("installed package lacks /%s", p)
		}
	}
	out, _ = inRoot(root, "cat", "/var/lib/dpkg/info/palisade.conffiles")
	if !strings.Contains(out, "/etc/palisade/palisade.toml\n") {
		t.Errorf("palisade.toml is not a conffile: %q", out)
	}
	// The generated completion script loads in bash and completes commands.
	out, err = inRoot(root, "bash", "-c", `. /usr/share/bash-completion/completions/palisade && complete -p palisade`)
	if err != nil || !strings.Contains(out, "palisade") {
		t.Errorf("bash completion: %v\n%s", err, out)
	}

	// Removal runs prerm (services off, data plane uninstalled — here in
	// the chroot's own empty network namespace) and keeps the conffile.
	if out, err := inRoot(root, "dpkg", "-r", "palisade"); err != nil {
		t.Fatalf("dpkg -r: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(root, "usr/bin/palisade")); err == nil {
		t.Error("dpkg -r left /usr/bin/palisade")
	}
	if _, err := os.Stat(conf); err != nil {
		t.Error("dpkg -r removed the conffile")
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
					d = "file:/usr/share/man/man" + m[2] + "/" + m[1] + "." + m[2]
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
// scripts; and that the Debian-built SPANK .so is not in it.
func TestRPMContents(t *testing.T) {
	_, rpm := build(t)
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
		"/usr/share/man/man1/palisade-agent.1", "/usr/share/bash-completion/completions/palisade", "/usr/share/doc/palisade/deploy.md"} {
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
	// The agent is restarted on upgrade only if the new version accepts the
	// configuration and its policy tests (postinst: agent=palisade-agent.service).
	if s := q("-qp", "--scripts"); !strings.Contains(s, "agent=palisade-agent.service") || !strings.Contains(s, "try-restart $agent") ||
		!strings.Contains(s, "agent --uninstall") {
		t.Errorf("rpm scripts:\n%s", s)
	}
	if v := q("-qp", "--qf", "%{VERSION}-%{RELEASE}"); v != testVersion+"-1" {
		t.Errorf("rpm version %q", v)
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
