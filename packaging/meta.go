package packaging

import (
	"bytes"
	"debug/buildinfo"
	"debug/elf"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/goreleaser/chglog"
	"github.com/goreleaser/nfpm/v2"
	"github.com/goreleaser/nfpm/v2/files"
)

// Release is the package release of every version (VERSION-1).
const Release = "1"

// strippedObject is an ELF file split for packaging: the stripped copy
// that is installed and its debug information, found by build ID.
type strippedObject struct {
	Stripped string
	Debug    string
	BuildID  string
	// GlibcMin is the newest GLIBC_ symbol version a dynamic object needs
	// ("" for the static palisade).
	GlibcMin string
}

// DebugPath is where the debug information of the object with this build
// ID is installed (gdb, systemd-coredump and debuginfod look there).
func DebugPath(buildID string) string {
	return "/usr/lib/debug/.build-id/" + buildID[:2] + "/" + buildID[2:] + ".debug"
}

// splitDebug copies the object's debug information to a file of its own
// and strips the copy that is installed (objcopy, binutils). The GNU build
// ID stays in both: it ties a core dump to its debug file. Go emits one
// only when linked with -B gobuildid (Makefile); gcc does by default.
func splitDebug(path, gen string) (*strippedObject, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	o := &strippedObject{}
	if s := f.Section(".note.gnu.build-id"); s != nil {
		if b, err := s.Data(); err == nil && len(b) > 16 {
			namesz, descsz := binary.LittleEndian.Uint32(b), binary.LittleEndian.Uint32(b[4:])
			off := 12 + (namesz+3)&^3
			if int(off+descsz) <= len(b) {
				o.BuildID = hex.EncodeToString(b[off : off+descsz])
			}
		}
	}
	if len(o.BuildID) < 8 {
		return nil, fmt.Errorf("%s has no GNU build ID (link Go with -ldflags=-B=gobuildid)", path)
	}
	if syms, err := f.DynamicSymbols(); err == nil {
		for _, s := range syms {
			v, ok := strings.CutPrefix(s.Version, "GLIBC_")
			if ok && (o.GlibcMin == "" || versionLess(o.GlibcMin, v)) {
				o.GlibcMin = v
			}
		}
	}
	dir := filepath.Join(gen, "obj", o.BuildID)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	o.Stripped, o.Debug = filepath.Join(dir, filepath.Base(path)), filepath.Join(dir, "debug")
	strip := "--strip-all"
	if f.Type == elf.ET_DYN && f.Section(".interp") == nil {
		strip = "--strip-unneeded" // a shared library keeps what it exports
	}
	for _, args := range [][]string{
		{"--only-keep-debug", path, o.Debug},
		{strip, "--remove-section=.comment", path, o.Stripped},
	} {
		if out, err := exec.Command("objcopy", args...).CombinedOutput(); err != nil {
			return nil, fmt.Errorf("objcopy %v (binutils): %v\n%s", args, err, out)
		}
	}
	return o, nil
}

// versionLess compares dotted numeric versions ("2.34" < "2.4" is false).
func versionLess(a, b string) bool {
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(as) || i < len(bs); i++ {
		var x, y int
		if i < len(as) {
			x, _ = strconv.Atoi(as[i])
		}
		if i < len(bs) {
			y, _ = strconv.Atoi(bs[i])
		}
		if x != y {
			return x < y
		}
	}
	return false
}

// debugInfo is the package of the debug files: palisade-dbgsym (.deb, as
// Debian names its automatic debug packages) or palisade-debuginfo (.rpm).
func (o Options) debugInfo(format string, objs []*strippedObject, lic licenses, changelog string) *nfpm.Info {
	mode := func(m os.FileMode) *files.ContentFileInfo {
		return &files.ContentFileInfo{Mode: m, Owner: "root", Group: "root", MTime: o.Date}
	}
	var c files.Contents
	var ids []string
	for _, obj := range objs {
		c = append(c, &files.Content{Source: obj.Debug, Destination: DebugPath(obj.BuildID), FileInfo: mode(0o644)})
		if format == "rpm" { // as Fedora's debuginfo packages own theirs
			c = append(c, &files.Content{Destination: filepath.Dir(DebugPath(obj.BuildID)), Type: files.TypeDir, FileInfo: mode(0o755)})
		}
		ids = append(ids, obj.BuildID)
	}
	info := &nfpm.Info{
		Arch: "amd64", Platform: "linux", Version: o.Version, VersionSchema: "none", Release: Release,
		Priority: "optional", Maintainer: o.Maintainer,
		Homepage: "https://github.com/palisade-hpc/palisade", Vendor: "Palisade", MTime: o.Date,
		Changelog: changelog,
	}
	switch format {
	case "deb":
		info.Name, info.Section = "palisade-dbgsym", "debug"
		info.Description = "debug symbols for palisade"
		// Debian's copyright is the main package's (doc directory linked).
		c = append(c, &files.Content{Source: "palisade", Destination: "/usr/share/doc/palisade-dbgsym", Type: files.TypeSymlink, FileInfo: mode(0o777)})
		info.Depends = []string{"palisade (= " + o.Version + "-" + Release + ")"}
		info.Changelog = "" // the main package's (doc directory linked)
		info.Deb.Fields = map[string]string{"Auto-Built-Package": "debug-symbols", "Build-Ids": strings.Join(ids, " ")}
	case "rpm":
		info.Name, info.License = "palisade-debuginfo", lic.expression()
		info.Description = "Debug information for package palisade\n" +
			"The debug information of the palisade binary and the uvn SPANK plugin,\n" +
			"found by build ID (gdb, systemd-coredump)."
		info.RPM = nfpm.RPM{Summary: "Debug information for package palisade", Group: "Development/Debug"}
		info.Depends = []string{"palisade = " + o.Version + "-" + Release}
	}
	info.Contents = c
	return nfpm.WithDefaults(info)
}

// licenses are the SPDX identifiers of everything in the packages.
type licenses []string

// expression is the rpm License tag: every licence that applies.
func (l licenses) expression() string { return strings.Join(l, " AND ") }

// licence kinds: SPDX identifier, Debian's short name, whether Debian
// ships the text in /usr/share/common-licenses, and how to recognise it.
type licenceKind struct {
	spdx, debian string
	common       bool
	match        func(string) bool
}

var licenceKinds = []licenceKind{
	{"Apache-2.0", "Apache-2.0", true, func(t string) bool {
		return strings.Contains(t, "Apache License") && strings.Contains(t, "Version 2.0")
	}},
	{"MIT", "Expat", false, func(t string) bool {
		return strings.Contains(t, "Permission is hereby granted, free of charge")
	}},
	{"BSD-3-Clause", "BSD-3-clause", false, func(t string) bool {
		return strings.Contains(t, "Redistribution and use in source and binary forms") &&
			(strings.Contains(t, "Neither the name") || strings.Contains(t, "names of its contributors"))
	}},
	{"BSD-2-Clause", "BSD-2-clause", false, func(t string) bool {
		return strings.Contains(t, "Redistribution and use in source and binary forms")
	}},
}

var licenceFile = regexp.MustCompile(`(?i)^(licen[cs]e|copying)(\.md|\.txt)?$`)

// copyrightLine: a holder's line in a licence text; Apache's appendix
// template ("Copyright [yyyy] [name of copyright owner]") is none.
var copyrightLine = regexp.MustCompile(`^(?:#\s*)?Copyright\s+(?:\(c\)\s*|©\s*)?(.*\d{4}.*)$`)

// writeCopyright writes the Debian machine-readable copyright file of the
// package (also the rpm's %license): the project's own code, the eBPF
// programs, and every Go module linked into binary, as its build
// information lists them, with the licence text from the module cache.
func writeCopyright(root, binary, out string) (licenses, error) {
	bi, err := buildinfo.ReadFile(binary)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", binary, err)
	}
	goenv, err := exec.Command("go", "env", "GOMODCACHE", "GOROOT").Output()
	if err != nil {
		return nil, fmt.Errorf("go env GOMODCACHE GOROOT: %v", err)
	}
	modcache, goroot, _ := strings.Cut(strings.TrimSpace(string(goenv)), "\n")
	var b strings.Builder
	b.WriteString("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n" +
		"Upstream-Name: palisade\nSource: https://github.com/palisade-hpc/palisade\n\n" +
		"Files: *\nCopyright: the Palisade developers\nLicense: Apache-2.0\n\n")
	bpf, _ := filepath.Glob(filepath.Join(root, "internal/dataplane/*/bpf/*.c"))
	var gpl []string
	for _, p := range bpf {
		src, err := os.ReadFile(p)
		if err != nil {
			return nil, err
		}
		if !bytes.Contains(src, []byte("SPDX-License-Identifier: GPL-2.0\n")) {
			return nil, fmt.Errorf("%s: no SPDX GPL-2.0 line (the kernel requires GPL-compatible eBPF programs)", p)
		}
		rel, _ := filepath.Rel(root, p)
		gpl = append(gpl, rel)
	}
	if len(gpl) == 0 {
		return nil, fmt.Errorf("no eBPF sources under %s", root)
	}
	b.WriteString("Files: " + strings.Join(gpl, "\n ") + "\n internal/dataplane/include/vmlinux.h\n" +
		"Copyright: the Palisade developers\nLicense: GPL-2\n" +
		"Comment: The eBPF programs, compiled into the palisade binary: the kernel\n" +
		" lets only GPL-compatible programs call the helpers they use. vmlinux.h\n" +
		" holds kernel type definitions generated from a kernel's BTF.\n\n")
	used := map[string]bool{"Apache-2.0": true, "GPL-2": true}
	spdx := map[string]bool{"Apache-2.0": true, "GPL-2.0-only": true}
	type mod struct{ path, dir string }
	mods := []mod{{"golang.org/go (the Go standard library and runtime)", goroot}}
	for _, d := range bi.Deps {
		if d.Replace != nil {
			d = d.Replace
		}
		mods = append(mods, mod{d.Path + " " + d.Version, filepath.Join(modcache, escapeModule(d.Path)+"@"+d.Version)})
	}
	for _, m := range mods {
		ents, err := os.ReadDir(m.dir)
		if err != nil {
			return nil, fmt.Errorf("module %s: %w (go mod download)", m.path, err)
		}
		var text string
		for _, e := range ents {
			if licenceFile.MatchString(e.Name()) {
				t, err := os.ReadFile(filepath.Join(m.dir, e.Name()))
				if err != nil {
					return nil, err
				}
				text = string(t)
				break
			}
		}
		if text == "" {
			return nil, fmt.Errorf("module %s: no licence file in %s", m.path, m.dir)
		}
		k := slices.IndexFunc(licenceKinds, func(k licenceKind) bool { return k.match(text) })
		if k < 0 {
			return nil, fmt.Errorf("module %s: licence not recognised (packaging/meta.go licenceKinds)", m.path)
		}
		kind := licenceKinds[k]
		used[kind.debian], spdx[kind.spdx] = true, true
		var holders []string
		for _, line := range strings.Split(text, "\n") {
			if mm := copyrightLine.FindStringSubmatch(strings.TrimSpace(line)); mm != nil && !strings.Contains(line, "[yyyy]") {
				holders = append(holders, strings.TrimSpace(mm[1]))
			}
		}
		name, _, _ := strings.Cut(m.path, " ")
		if len(holders) == 0 {
			holders = []string{"the authors of " + name}
		}
		fmt.Fprintf(&b, "Files: %s/*\nCopyright: %s\nLicense: %s\n", name, strings.Join(holders, "\n "), kind.debian)
		if !kind.common {
			b.WriteString(indent(text))
		}
		fmt.Fprintf(&b, "Comment: Go module %s, linked into the palisade binary.\n\n", m.path)
	}
	b.WriteString("License: Apache-2.0\n On Debian systems, the complete text of the Apache License, Version 2.0,\n" +
		" can be found in \"/usr/share/common-licenses/Apache-2.0\".\n\n" +
		"License: GPL-2\n On Debian systems, the complete text of the GNU General Public License\n" +
		" version 2 can be found in \"/usr/share/common-licenses/GPL-2\".\n")
	var l licenses
	for _, k := range []string{"Apache-2.0", "GPL-2.0-only", "MIT", "BSD-3-Clause", "BSD-2-Clause"} {
		if spdx[k] {
			l = append(l, k)
		}
	}
	return l, os.WriteFile(out, []byte(b.String()), 0o644)
}

// indent formats a licence text as a copyright-format field's
// continuation lines (empty lines as " .").
func indent(text string) string {
	var b strings.Builder
	for _, line := range strings.Split(strings.TrimRight(strings.ReplaceAll(text, "\r", ""), "\n "), "\n") {
		line = strings.TrimRight(strings.ReplaceAll(line, "\t", "    "), " ")
		if line == "" {
			line = "."
		}
		b.WriteString(" " + line + "\n")
	}
	return b.String()
}

// escapeModule is a module path as the module cache spells it: every
// upper-case letter as '!' and its lower case.
func escapeModule(p string) string {
	var b strings.Builder
	for _, r := range p {
		if 'A' <= r && r <= 'Z' {
			b.WriteByte('!')
			r += 'a' - 'A'
		}
		b.WriteRune(r)
	}
	return b.String()
}

// writeChangelog writes the changelog both packages carry (nfpm formats
// it: /usr/share/doc/palisade/changelog.Debian.gz, rpm %changelog) from
// packaging/changelog.yml, whose entries are releases. A build of a
// version the file does not list (a development snapshot) gets an entry of
// its own, dated with the build.
func writeChangelog(root, out, version, maintainer string, date time.Time) error {
	src := filepath.Join(root, "packaging/changelog.yml")
	if _, err := os.Stat(src); err != nil {
		return err
	}
	entries, err := chglog.Parse(src)
	if err != nil {
		return err
	}
	if !slices.ContainsFunc(entries, func(e *chglog.ChangeLog) bool { return e.Semver == version }) {
		entries = append(chglog.ChangeLogEntries{{
			Semver: version, Date: date,
			Changes: chglog.ChangeLogChanges{{Note: "Development snapshot: see the project's history for the changes."}},
		}}, entries...)
	}
	if len(entries) == 0 {
		return errors.New("packaging/changelog.yml: no entries")
	}
	for _, e := range entries {
		e.Semver += "-" + Release
		if e.Packager == "" {
			e.Packager = maintainer
		}
		if e.Deb == nil {
			e.Deb = &chglog.ChangelogDeb{Urgency: "medium", Distributions: []string{"unstable"}}
		}
	}
	return entries.Save(out)
}
