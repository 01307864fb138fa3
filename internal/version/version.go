// Package version says which build of Palisade is running. The release
// version, commit and build date are stamped by the linker
// (-ldflags "-X github.com/palisade-hpc/palisade/internal/version.version=…",
// see the Makefile); the Go toolchain and the cilium/ebpf module come from
// the build information Go embeds in every binary.
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"
)

// Set by the linker; empty in a plain `go build`.
var (
	version string
	commit  string
	date    string
)

// Info is one build's identity.
type Info struct {
	Version   string `json:"version"`
	Commit    string `json:"commit"`
	BuildDate string `json:"build_date"`
	GoVersion string `json:"go_version"`
	EBPF      string `json:"cilium_ebpf"`
}

// Get returns this binary's build information. Fields the linker did not set
// fall back to what the Go build info holds (the VCS revision when built
// with -buildvcs) or to "unknown"; Version is "devel" for an unstamped build.
func Get() Info {
	i := Info{Version: version, Commit: commit, BuildDate: date, GoVersion: runtime.Version(), EBPF: "unknown"}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == "github.com/cilium/ebpf" {
				i.EBPF = d.Version
				if d.Replace != nil {
					i.EBPF = d.Replace.Version + " (replaced)"
				}
			}
		}
		for _, s := range bi.Settings {
			switch {
			case s.Key == "vcs.revision" && i.Commit == "":
				i.Commit = s.Value
			case s.Key == "vcs.time" && i.BuildDate == "":
				i.BuildDate = s.Value
			}
		}
	}
	if i.Version == "" {
		i.Version = "devel"
	}
	if i.Commit == "" {
		i.Commit = "unknown"
	}
	if i.BuildDate == "" {
		i.BuildDate = "unknown"
	}
	return i
}

// Version is the release version alone (e.g. "0.3.0" or "devel").
func Version() string { return Get().Version }

// String is the one-line form logged by daemons and printed by --version.
func (i Info) String() string { return i.Line("palisade") }

// Line is the one-line form for the named program (palisade, palisade-lab).
func (i Info) Line(program string) string {
	return fmt.Sprintf("%s %s (commit %s, built %s, %s, cilium/ebpf %s)",
		program, i.Version, short(i.Commit), i.BuildDate, i.GoVersion, i.EBPF)
}

// Long is the multi-line form of `palisade version`.
func (i Info) Long() string {
	var b strings.Builder
	fmt.Fprintf(&b, "version:     %s\n", i.Version)
	fmt.Fprintf(&b, "commit:      %s\n", i.Commit)
	fmt.Fprintf(&b, "build date:  %s\n", i.BuildDate)
	fmt.Fprintf(&b, "go:          %s %s/%s\n", i.GoVersion, runtime.GOOS, runtime.GOARCH)
	fmt.Fprintf(&b, "cilium/ebpf: %s\n", i.EBPF)
	return b.String()
}

func short(c string) string {
	if len(c) > 12 {
		return c[:12]
	}
	return c
}
