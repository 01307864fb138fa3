package userwall

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/packaging/systemd"
)

// UnitSandbox is how palisade-agent.service runs the agent, read from the
// shipped unit: its capability bounding set, NoNewPrivileges=, the paths
// ProtectSystem= and ProtectHome= make read-only, UMask= and the system
// call filter (SystemCallFilter=, SystemCallErrorNumber=,
// SystemCallArchitectures=native; seccomp.go). The agent runs as root (the
// unit has no User=).
type UnitSandbox struct {
	Caps       []string // lower-case names without "cap_", as setpriv takes them
	NoNewPrivs bool
	ReadOnly   []string
	Umask      string   // octal, "" = systemd's default 0022
	Syscalls   []string // SystemCallFilter= allow list (names, @groups); nil = no filter
	SysErrno   int      // SystemCallErrorNumber= (0: a refused call kills the process)
	NativeArch bool     // SystemCallArchitectures=native
}

// AgentUnit parses the shipped agent unit. A setting the lab cannot emulate
// is an error, so that a change to the unit cannot go untested.
func AgentUnit() (UnitSandbox, error) { return parseUnit(systemd.Agent) }

func parseUnit(text string) (UnitSandbox, error) {
	var u UnitSandbox
	section := ""
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		if strings.HasPrefix(line, "[") {
			section = line
			continue
		}
		k, v, _ := strings.Cut(line, "=")
		if section != "[Service]" {
			continue
		}
		switch k {
		case "CapabilityBoundingSet":
			if strings.HasPrefix(v, "~") {
				return u, fmt.Errorf("CapabilityBoundingSet=~ (a deny list) is not emulated")
			}
			for _, c := range strings.Fields(v) {
				u.Caps = append(u.Caps, strings.TrimPrefix(strings.ToLower(c), "cap_"))
			}
		case "NoNewPrivileges":
			u.NoNewPrivs = v == "yes" || v == "true"
		case "ProtectSystem":
			switch v {
			case "yes", "true":
				u.ReadOnly = append(u.ReadOnly, "/usr", "/boot", "/efi")
			case "full":
				u.ReadOnly = append(u.ReadOnly, "/usr", "/boot", "/efi", "/etc")
			default:
				return u, fmt.Errorf("ProtectSystem=%s is not emulated", v)
			}
		case "ProtectHome":
			switch v {
			case "read-only":
				u.ReadOnly = append(u.ReadOnly, "/home", "/root", "/run/user")
			default:
				return u, fmt.Errorf("ProtectHome=%s is not emulated", v)
			}
		case "UMask":
			if _, err := strconv.ParseUint(v, 8, 32); err != nil {
				return u, fmt.Errorf("UMask=%s: want octal", v)
			}
			u.Umask = v
		case "SystemCallFilter":
			if strings.HasPrefix(v, "~") {
				return u, fmt.Errorf("SystemCallFilter=~ (a deny list) is not emulated")
			}
			if v == "" {
				u.Syscalls = nil
				continue
			}
			u.Syscalls = append(u.Syscalls, strings.Fields(v)...) // lines add up, as in systemd
		case "SystemCallErrorNumber":
			for e := syscall.Errno(1); e < 256 && u.SysErrno == 0; e++ {
				if unix.ErrnoName(e) == v {
					u.SysErrno = int(e)
				}
			}
			if u.SysErrno == 0 {
				return u, fmt.Errorf("SystemCallErrorNumber=%s is not emulated (an errno name)", v)
			}
		case "SystemCallArchitectures":
			if v != "native" {
				return u, fmt.Errorf("SystemCallArchitectures=%s is not emulated (native is)", v)
			}
			u.NativeArch = true
		case "User", "DynamicUser", "AmbientCapabilities", "ProtectKernelTunables", "ProtectControlGroups",
			"PrivateTmp", "PrivateDevices", "ReadOnlyPaths", "InaccessiblePaths", "RestrictAddressFamilies":
			return u, fmt.Errorf("%s= is not emulated by the lab (lab/modes/userwall/unit.go): add it", k)
		}
	}
	if len(u.Caps) == 0 {
		return u, fmt.Errorf("the unit has no CapabilityBoundingSet")
	}
	if (u.SysErrno != 0 || u.NativeArch) && u.Syscalls == nil {
		return u, fmt.Errorf("SystemCallErrorNumber= or SystemCallArchitectures= without SystemCallFilter= is not emulated")
	}
	slices.Sort(u.Caps)
	return u, nil
}

// Prefix is the argv prefix that execs the rest as the unit would: a mount
// namespace of its own (slave: the host's bpffs and cgroup mounts stay
// visible) with the protected paths read-only and the unit's umask, then
// setpriv with the bounding set, nothing inheritable and no_new_privs, then
// (lab: the lab binary) the system call filter. Root's permitted and
// effective sets after exec are the bounding set, as under systemd.
func (u UnitSandbox) Prefix(lab string) ([]string, error) {
	caps := "-all"
	for _, c := range u.Caps {
		caps += ",+" + c
	}
	setpriv := []string{"setpriv", "--inh-caps=-all", "--bounding-set=" + caps}
	if u.NoNewPrivs {
		setpriv = append(setpriv, "--no-new-privs")
	}
	setpriv = append(setpriv, "--")
	if u.Syscalls != nil {
		allow, err := resolveSyscalls(u.Syscalls)
		if err != nil {
			return nil, err
		}
		nums := make([]string, len(allow))
		for i, n := range allow {
			nums[i] = strconv.FormatUint(uint64(n), 10)
		}
		setpriv = append(setpriv, lab, UnitExecCommand, "--allow", strings.Join(nums, ","), "--errno", strconv.Itoa(u.SysErrno), "--")
	}
	umask := cmp.Or(u.Umask, "0022")
	script := `umask ` + umask + `; ro=$1; shift; for d in $ro; do [ -d "$d" ] || continue; mount --rbind "$d" "$d" && mount -o remount,bind,ro "$d" || exit 1; done; exec "$@"`
	return append([]string{"unshare", "--mount", "--propagation", "slave", "--", "/bin/sh", "-c", script, "sh", strings.Join(u.ReadOnly, " ")}, setpriv...), nil
}

// UnitExecCommand is the lab's hidden command that applies the filter
// (UnitExec).
const UnitExecCommand = "__unit-exec"
