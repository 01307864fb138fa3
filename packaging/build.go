// Package packaging builds Palisade's .deb and .rpm with nfpm (as a Go
// library: no dpkg-deb or rpmbuild needed) from a built binary, the files in
// this directory and pages generated from the command tree (man pages, shell
// completions). `make package` runs it through ./packaging/mkpkg.
package packaging

import (
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/goreleaser/nfpm/v2"
	_ "github.com/goreleaser/nfpm/v2/deb" // registers the "deb" packager
	"github.com/goreleaser/nfpm/v2/files"
	_ "github.com/goreleaser/nfpm/v2/rpm" // registers the "rpm" packager
	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"

	"github.com/palisade-hpc/palisade/internal/cli"
)

// Paths on the installed system. The binary has ONE path, used by the
// units, the PAM line, the SPANK plugin's plugstack.conf line and the docs:
// /usr/bin, because users run it too (palisade explain, status).
const (
	BinPath    = "/usr/bin/palisade"
	ConfigPath = "/etc/palisade/palisade.toml"
	// SpankSOPath: the .deb's plugin, built for Debian's Slurm, in a
	// directory of its own; a site's build (packaging/spank/Makefile)
	// installs under /usr/local and never collides with it.
	SpankSOPath = "/usr/lib/palisade/spank/pal_uvn_spank.so"
	UnitDir     = "/usr/lib/systemd/system"
	ManDir      = "/usr/share/man/man1"
	DocDir      = "/usr/share/doc/palisade"
)

// Options say what to package.
type Options struct {
	// Root is the source tree (the module root).
	Root string
	// Binary is the built palisade binary (stamped with Version).
	Binary string
	// SpankSO is the SPANK plugin built for Debian's Slurm; it goes into
	// the .deb only ("" = none): slurmstepd loads only a plugin built for
	// its own Slurm version, so the .rpm ships the source and recipe.
	SpankSO string
	// Version is the package version (0.0.0~N.gHASH or a release).
	Version string
	// Date stamps the man pages and the files' mtimes (reproducible builds).
	Date time.Time
	// OutDir receives the packages.
	OutDir string
	// Formats to build; default deb and rpm.
	Formats []string
	// Maintainer of the packages ("Name <address>"); default
	// DefaultMaintainer. A site that rebuilds them names itself.
	Maintainer string
	// NoDebug leaves out the debug packages (palisade-dbgsym .deb,
	// palisade-debuginfo .rpm).
	NoDebug bool
}

// DefaultMaintainer is the Maintainer of the project's own packages.
const DefaultMaintainer = "Palisade developers <palisade-hpc@users.noreply.github.com>"

// Build writes the packages and returns their paths.
func Build(o Options) ([]string, error) {
	if o.Version == "" || o.Binary == "" || o.OutDir == "" {
		return nil, errors.New("packaging: Version, Binary and OutDir are required")
	}
	if strings.ContainsAny(o.Version, "- ") {
		return nil, fmt.Errorf("packaging: version %q: no '-' or space (dpkg and rpm use '-' for the release)", o.Version)
	}
	if len(o.Formats) == 0 {
		o.Formats = []string{"deb", "rpm"}
	}
	if o.Date.IsZero() {
		o.Date = time.Unix(0, 0).UTC()
	}
	gen, err := os.MkdirTemp("", "palpkg")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(gen)
	if o.Maintainer == "" {
		o.Maintainer = DefaultMaintainer
	}
	if err := Generate(gen, o.Version, o.Date); err != nil {
		return nil, err
	}
	if err := compressManPages(filepath.Join(gen, "man"), o.Date); err != nil {
		return nil, err
	}
	// Stripped binaries, their debug information split off by build ID.
	bin, err := splitDebug(o.Binary, gen)
	if err != nil {
		return nil, err
	}
	objs := []*strippedObject{bin}
	var spank *strippedObject
	if o.SpankSO != "" {
		if spank, err = splitDebug(o.SpankSO, gen); err != nil {
			return nil, err
		}
		objs = append(objs, spank)
	}
	lic, err := writeCopyright(o.Root, o.Binary, filepath.Join(gen, "copyright"))
	if err != nil {
		return nil, err
	}
	if err := writeChangelog(o.Root, filepath.Join(gen, "changelog.yml"), o.Version, o.Maintainer, o.Date); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(o.OutDir, 0o755); err != nil {
		return nil, err
	}
	var out []string
	for _, format := range o.Formats {
		info, err := o.info(format, gen, bin, spank, lic)
		if err != nil {
			return out, err
		}
		infos := []*nfpm.Info{info}
		if !o.NoDebug {
			infos = append(infos, o.debugInfo(format, objs, lic, filepath.Join(gen, "changelog.yml")))
		}
		for _, info := range infos {
			path, err := write(format, info, o.OutDir)
			if err != nil {
				return out, err
			}
			out = append(out, path)
		}
	}
	return out, nil
}

func write(format string, info *nfpm.Info, dir string) (string, error) {
	p, err := nfpm.Get(format)
	if err != nil {
		return "", err
	}
	if err := nfpm.PrepareForPackager(info, format); err != nil {
		return "", fmt.Errorf("%s: %w", format, err)
	}
	path := filepath.Join(dir, p.ConventionalFileName(info))
	var buf bytes.Buffer
	if err := p.Package(info, &buf); err != nil {
		return "", fmt.Errorf("%s: %w", format, err)
	}
	return path, os.WriteFile(path, buf.Bytes(), 0o644)
}

// compressManPages gzips every page in dir (gzip -9n: no name, no time,
// so that one commit gives the same packages).
func compressManPages(dir string, date time.Time) error {
	pages, err := filepath.Glob(filepath.Join(dir, "*.1"))
	if err != nil || len(pages) == 0 {
		return fmt.Errorf("no man pages generated (%v)", err)
	}
	for _, p := range pages {
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		var buf bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&buf, gzip.BestCompression)
		if _, err := zw.Write(b); err != nil {
			return err
		}
		if err := zw.Close(); err != nil {
			return err
		}
		if err := os.WriteFile(p+".gz", buf.Bytes(), 0o644); err != nil {
			return err
		}
		if err := os.Remove(p); err != nil {
			return err
		}
	}
	return nil
}

// Generate writes the man pages (man/) and shell completions (completions/)
// of the command tree into dir.
func Generate(dir, version string, date time.Time) error {
	root := cli.New()
	man := filepath.Join(dir, "man")
	if err := os.MkdirAll(man, 0o755); err != nil {
		return err
	}
	hdr := &doc.GenManHeader{Section: "1", Date: &date, Source: "Palisade " + version, Manual: "Palisade Manual"}
	root.DisableAutoGenTag = true
	if err := doc.GenManTree(root, hdr, man); err != nil {
		return fmt.Errorf("man pages: %w", err)
	}
	comp := filepath.Join(dir, "completions")
	if err := os.MkdirAll(comp, 0o755); err != nil {
		return err
	}
	for name, gen := range map[string]func(*cobra.Command, string) error{
		"palisade.bash": func(c *cobra.Command, p string) error { return c.GenBashCompletionFileV2(p, true) },
		"_palisade":     func(c *cobra.Command, p string) error { return c.GenZshCompletionFile(p) },
		"palisade.fish": func(c *cobra.Command, p string) error { return c.GenFishCompletionFile(p, true) },
	} {
		if err := gen(root, filepath.Join(comp, name)); err != nil {
			return fmt.Errorf("completion %s: %w", name, err)
		}
	}
	return nil
}

// docs are the documents installed under DocDir (the lab's are left out).
var docs = []string{"README.md", "docs/deploy.md", "docs/users.md", "docs/policy.md", "docs/userwall.md",
	"docs/ident.md", "docs/uvn.md", "docs/egress.md"}

func (o Options) info(format, gen string, bin, spank *strippedObject, lic licenses) (*nfpm.Info, error) {
	src := func(p string) string { return filepath.Join(o.Root, p) }
	mode := func(m os.FileMode) *files.ContentFileInfo {
		return &files.ContentFileInfo{Mode: m, Owner: "root", Group: "root", MTime: o.Date}
	}
	doc := "" // rpm marks documentation %doc (rpm --excludedocs)
	zsh := "/usr/share/zsh/vendor-completions/_palisade"
	if format == "rpm" {
		doc = files.TypeRPMDoc
		zsh = "/usr/share/zsh/site-functions/_palisade" // RHEL's, as its zsh reads
	}
	c := files.Contents{
		{Source: bin.Stripped, Destination: BinPath, FileInfo: mode(0o755)},
		{Source: src("packaging/palisade.toml"), Destination: ConfigPath, Type: files.TypeConfigNoReplace, FileInfo: mode(0o644)},
		{Destination: "/etc/palisade", Type: files.TypeDir, FileInfo: mode(0o755)},
		// The logs themselves are 0640 (the agent, logrotate's create).
		{Destination: "/var/log/palisade", Type: files.TypeDir, FileInfo: mode(0o755)},
		{Source: src("packaging/logrotate/palisade"), Destination: "/etc/logrotate.d/palisade", Type: files.TypeConfigNoReplace, FileInfo: mode(0o644)},
		{Source: src("internal/dataplane/uvn/spank/c/pal_uvn_spank.c"), Destination: "/usr/share/palisade/spank/pal_uvn_spank.c", FileInfo: mode(0o644)},
		{Source: src("packaging/spank/Makefile"), Destination: "/usr/share/palisade/spank/Makefile", FileInfo: mode(0o644)},
		{Source: src("packaging/systemd/slurmd-palisade.conf"), Destination: "/usr/share/palisade/systemd/slurmd-palisade.conf", FileInfo: mode(0o644)},
		{Source: filepath.Join(gen, "completions/palisade.bash"), Destination: "/usr/share/bash-completion/completions/palisade", FileInfo: mode(0o644)},
		{Source: filepath.Join(gen, "completions/_palisade"), Destination: zsh, FileInfo: mode(0o644)},
		{Source: filepath.Join(gen, "completions/palisade.fish"), Destination: "/usr/share/fish/vendor_completions.d/palisade.fish", FileInfo: mode(0o644)},
	}
	for _, u := range []string{"palisade-agent.service", "palisade-ident.service", "palisade-gateway.service"} {
		c = append(c, &files.Content{Source: src("packaging/systemd/" + u), Destination: UnitDir + "/" + u, FileInfo: mode(0o644)})
	}
	for _, d := range []string{"packaging/prometheus/palisade-alerts.yml", "packaging/grafana/palisade.json"} {
		if _, err := os.Stat(src(d)); err == nil {
			c = append(c, &files.Content{Source: src(d), Destination: "/usr/share/palisade/" + filepath.Base(d), FileInfo: mode(0o644)})
		}
	}
	for _, d := range docs {
		if _, err := os.Stat(src(d)); err != nil {
			return nil, fmt.Errorf("document %s: %w", d, err)
		}
		c = append(c, &files.Content{Source: src(d), Destination: DocDir + "/" + filepath.Base(d), Type: doc, FileInfo: mode(0o644)})
	}
	pages, err := filepath.Glob(filepath.Join(gen, "man", "*.1.gz"))
	if err != nil || len(pages) == 0 {
		return nil, fmt.Errorf("no man pages generated (%v)", err)
	}
	for _, p := range pages {
		c = append(c, &files.Content{Source: p, Destination: ManDir + "/" + filepath.Base(p), Type: doc, FileInfo: mode(0o644)})
	}
	// The licence and copyright of everything in the binary: the
	// project's own code and each Go module linked into it.
	var depends, suggests []string
	postrm := src("packaging/scripts/postrm.sh")
	switch format {
	case "deb":
		c = append(c,
			&files.Content{Source: filepath.Join(gen, "copyright"), Destination: DocDir + "/copyright", FileInfo: mode(0o644)},
			// Tags that stay, each with the reason (lintian reads this file).
			&files.Content{Source: src("packaging/lintian/palisade"), Destination: "/usr/share/lintian/overrides/palisade", FileInfo: mode(0o644)})
		if spank != nil {
			// A shared object (unlike the static palisade) needs the C
			// library it was linked against: at least the newest symbol
			// version it uses.
			c = append(c, &files.Content{Source: spank.Stripped, Destination: SpankSOPath, FileInfo: mode(0o644)})
			depends = append(depends, "libc6 (>= "+spank.GlibcMin+")")
		}
		// The uvn plugin is for Debian's slurmstepd; the agent orders
		// itself before slurmd (the unit) but needs no Slurm.
		suggests = append(suggests, "slurmd")
	case "rpm":
		c = append(c,
			&files.Content{Source: src("LICENSE"), Destination: "/usr/share/licenses/palisade/LICENSE", Type: files.TypeRPMLicense, FileInfo: mode(0o644)},
			&files.Content{Source: filepath.Join(gen, "copyright"), Destination: "/usr/share/licenses/palisade/copyright", Type: files.TypeRPMLicense, FileInfo: mode(0o644)})
		postrm = src("packaging/scripts/postun.sh") // rpm has no purge
		// rpm owns a directory only when the package lists it (dpkg
		// removes the directories it made when they empty).
		for _, d := range []string{"/usr/share/palisade", "/usr/share/palisade/spank", "/usr/share/palisade/systemd",
			DocDir, "/usr/share/licenses/palisade"} {
			c = append(c, &files.Content{Destination: d, Type: files.TypeDir, FileInfo: mode(0o755)})
		}
	}
	info := &nfpm.Info{
		Name:          "palisade",
		Arch:          "amd64",
		Platform:      "linux",
		Version:       o.Version,
		VersionSchema: "none",
		Release:       "1",
		Section:       "net",
		Priority:      "optional",
		Maintainer:    o.Maintainer,
		Changelog:     filepath.Join(gen, "changelog.yml"),
		Description: "Per-user network isolation for shared HPC clusters\n" +
			"An eBPF identity firewall (userwall agent) that lets a user's listeners\n" +
			"be reached only by the same user, their project groups and the system,\n" +
			"across the nodes of a cluster; with the ident service, the uvn SPANK\n" +
			"plugin, an egress gateway and operator tools (status, explain).",
		Vendor:   "Palisade",
		Homepage: "https://github.com/palisade-hpc/palisade",
		MTime:    o.Date,
		Overridables: nfpm.Overridables{
			Contents:   c,
			Depends:    depends,
			Recommends: []string{"logrotate"},
			Suggests:   suggests,
			Scripts: nfpm.Scripts{
				PostInstall: src("packaging/scripts/postinst.sh"),
				PreRemove:   src("packaging/scripts/prerm.sh"),
				PostRemove:  postrm,
			},
			RPM: nfpm.RPM{Summary: "Per-user network isolation for shared HPC clusters", Group: "System Environment/Daemons"},
		},
	}
	if format == "rpm" {
		info.License = lic.expression() // deb: in the copyright file
	}
	info = nfpm.WithDefaults(info)
	return info, nil
}
