package kernel

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/palisade-hpc/palisade/internal/sys/cgroup2"
)

// KernelFloor is the oldest kernel userwall supports (Debian 12's).
const KernelFloor = "6.1"

// Feature is one kernel capability the data plane uses, as probed on the
// running kernel (the kernel is asked, not its version number: backports and
// configuration decide, e.g. on RHEL).
type Feature struct {
	Name    string `json:"name"`
	Since   string `json:"since,omitempty"` // upstream version that brought it ("" unknown)
	Present bool   `json:"present"`
	// Required: the agent refuses to start without it. Otherwise Fallback
	// says what Palisade does instead.
	Required bool   `json:"required"`
	Fallback string `json:"fallback,omitempty"`
	// Needs lists what depends on it (programs, attach points).
	Needs  []string `json:"needed_by,omitempty"`
	Detail string   `json:"detail,omitempty"` // why absent, or how it was determined
}

// Probe is the feature table of the running kernel.
type Probe struct {
	Kernel   string    `json:"kernel"`
	Floor    string    `json:"floor"`
	Features []Feature `json:"features"`
}

// Missing returns the required features the kernel lacks.
func (p *Probe) Missing() []Feature {
	var out []Feature
	for _, f := range p.Features {
		if f.Required && !f.Present {
			out = append(out, f)
		}
	}
	return out
}

// Has reports whether the named feature is present.
func (p *Probe) Has(name string) bool {
	for _, f := range p.Features {
		if f.Name == name {
			return f.Present
		}
	}
	return false
}

// Err is the one clear message the agent refuses with, or nil.
func (p *Probe) Err() error {
	miss := p.Missing()
	if len(miss) == 0 {
		return nil
	}
	var parts []string
	for _, f := range miss {
		s := f.Name
		if f.Since != "" {
			s += " (Linux " + f.Since + ")"
		}
		if f.Detail != "" {
			s += ": " + f.Detail
		}
		if len(f.Needs) > 0 {
			s += "; needed by " + strings.Join(f.Needs, ", ")
		}
		parts = append(parts, s)
	}
	return fmt.Errorf("this kernel (Linux %s) lacks what userwall needs: %s; userwall needs Linux >= %s with BTF and cgroup v2 (docs/userwall.md, Requirements); nothing was changed",
		p.Kernel, strings.Join(parts, "; "), p.Floor)
}

// Feature names the agent acts on.
const (
	FeatTCX       = "tcx links"
	FeatClsact    = "clsact qdisc + cls_bpf (direct action)"
	FeatLSMActive = "bpf LSM active (lsm=...,bpf)"
	FeatLSMAttach = "BPF LSM programs attach (trampolines)"
)

// helperSince is when each helper the programs may call came to upstream
// Linux (the program type can matter too; the probe asks the kernel).
var helperSince = map[string]string{
	"bpf_map_lookup_elem": "3.19", "bpf_map_update_elem": "3.19", "bpf_map_delete_elem": "3.19",
	"bpf_ktime_get_ns": "4.1", "bpf_ktime_get_boot_ns": "5.8", "bpf_skb_store_bytes": "4.1", "bpf_l3_csum_replace": "4.1", "bpf_l4_csum_replace": "4.1",
	"bpf_get_current_pid_tgid": "4.2", "bpf_get_current_uid_gid": "4.2", "bpf_get_current_comm": "4.2",
	"bpf_skb_load_bytes": "4.5", "bpf_csum_diff": "4.6", "bpf_get_socket_uid": "4.12",
	"bpf_skb_adjust_room": "4.13", "bpf_sk_lookup_tcp": "4.20", "bpf_sk_lookup_udp": "4.20", "bpf_sk_release": "4.20",
	"bpf_sk_fullsock": "5.1", "bpf_skc_lookup_tcp": "5.2", "bpf_sk_storage_get": "5.2", "bpf_sk_storage_delete": "5.2",
	"bpf_probe_read_kernel": "5.5", "bpf_get_netns_cookie": "5.7", "bpf_ringbuf_output": "5.8",
	"bpf_ringbuf_reserve": "5.8", "bpf_ringbuf_submit": "5.8", "bpf_ringbuf_discard": "5.8",
	"bpf_skc_to_tcp_sock": "5.9", "bpf_skc_to_udp6_sock": "5.9", "bpf_sock_ops_cb_flags_set": "4.16",
	"bpf_load_hdr_opt": "5.10", "bpf_store_hdr_opt": "5.10", "bpf_reserve_hdr_opt": "5.10",
	"bpf_get_current_task_btf": "5.11", "bpf_ktime_get_coarse_ns": "5.11", "bpf_check_mtu": "5.12", "bpf_loop": "5.17",
	"bpf_skb_cgroup_id": "4.18", "bpf_sk_cgroup_id": "5.8", "bpf_get_current_cgroup_id": "4.18",
}

// kfuncSince: kfuncs exist only from the versions given (and their use is
// what put userwall above 6.1 before data plane v2).
var kfuncSince = map[string]string{
	"bpf_cast_to_kern_ctx": "6.3", "bpf_rdonly_cast": "6.3",
}

// mapSince is when each map type came.
var mapSince = map[ebpf.MapType]string{
	ebpf.Hash: "3.19", ebpf.Array: "3.19", ebpf.PerCPUArray: "4.6", ebpf.PerCPUHash: "4.6",
	ebpf.LRUHash: "4.10", ebpf.LPMTrie: "4.11", ebpf.SkStorage: "5.2", ebpf.RingBuf: "5.8",
}

var progTypeSince = map[ebpf.ProgramType]string{
	ebpf.SchedCLS: "4.1", ebpf.CGroupSKB: "4.10", ebpf.CGroupSock: "4.10", ebpf.SockOps: "4.13",
	ebpf.CGroupSockAddr: "4.17", ebpf.LSM: "5.7", ebpf.Tracing: "5.5",
}

// optionalProgs are programs the agent can run without (their feature then
// has a fallback instead of refusing).
var optionalProgs = map[string]string{
	progUnixStream: "abstract Unix sockets are not isolated (status warns)",
	progUnixDgram:  "abstract Unix sockets are not isolated (status warns)",
}

// ProbeKernel checks every kernel feature the compiled data plane uses:
// program and map types, every helper each program calls (for its program
// type), kfuncs, BTF, SO_NETNS_COOKIE, cgroup v2, tcx or clsact, and the bpf
// LSM. It loads only throw-away probe programs (a no-op LSM program is
// attached and detached at once) and changes nothing on the node.
func ProbeKernel() (*Probe, error) {
	spec, err := loadUwbpf()
	if err != nil {
		return nil, err
	}
	p := &Probe{Kernel: kernelRelease(), Floor: KernelFloor}
	add := func(f Feature) { p.Features = append(p.Features, f) }

	kspec, btfErr := btf.LoadKernelSpec()
	f := Feature{Name: "BTF (/sys/kernel/btf/vmlinux)", Since: "5.4", Required: true, Present: btfErr == nil,
		Needs: []string{"CO-RE field access in every program", "LSM hooks"}}
	if btfErr != nil {
		f.Detail = btfErr.Error()
	}
	add(f)

	_, cookieErr := NetnsCookie()
	f = Feature{Name: "SO_NETNS_COOKIE", Since: "5.14", Required: true, Present: cookieErr == nil,
		Needs: []string{"per-namespace scoping (one agent per node namespace)"}}
	if cookieErr != nil {
		f.Detail = cookieErr.Error()
	}
	add(f)

	cg, cgErr := cgroup2.MountPoint()
	if cgErr != nil {
		// A command run with a fresh sysfs (`ip netns exec`, a testbed
		// login) sees no cgroup mount; the kernel's hierarchy is init's.
		if p, err := cgroup2.InitMountPoint(); err == nil {
			cg, cgErr = p+" in init's mount namespace", nil
		}
	}
	f = Feature{Name: "cgroup v2 hierarchy", Since: "4.5", Required: true, Present: cgErr == nil,
		Needs: []string{"socket hooks (connect, sendmsg, sock_create)"}, Detail: cg}
	if cgErr != nil {
		f.Detail = cgErr.Error()
	}
	add(f)

	// Program types, helpers and kfuncs, straight from the object.
	type use struct {
		since    string
		progs    []string
		optional bool
	}
	progTypes := map[ebpf.ProgramType]*use{}
	helpers := map[string]*use{} // "type/helper"
	helperOf := map[string][2]any{}
	kfuncs := map[string]*use{}
	names := make([]string, 0, len(spec.Programs))
	for n := range spec.Programs {
		names = append(names, n)
	}
	sort.Strings(names)
	note := func(m map[string]*use, key, since, prog string) {
		u := m[key]
		if u == nil {
			u = &use{since: since, optional: true}
			m[key] = u
		}
		if !slices.Contains(u.progs, prog) {
			u.progs = append(u.progs, prog)
		}
		if _, opt := optionalProgs[prog]; !opt {
			u.optional = false
		}
	}
	for _, n := range names {
		ps := spec.Programs[n]
		u := progTypes[ps.Type]
		if u == nil {
			u = &use{since: progTypeSince[ps.Type], optional: true}
			progTypes[ps.Type] = u
		}
		u.progs = append(u.progs, n)
		if _, opt := optionalProgs[n]; !opt {
			u.optional = false
		}
		for _, ins := range ps.Instructions {
			switch {
			case ins.IsKfuncCall():
				name := ins.Reference()
				note(kfuncs, name, kfuncSince[name], n)
			case ins.IsBuiltinCall():
				fn := asm.BuiltinFunc(ins.Constant)
				hn := helperName(fn)
				key := ps.Type.String() + "/" + hn
				note(helpers, key, helperSince[hn], n)
				helperOf[key] = [2]any{ps.Type, fn}
			}
		}
	}
	optional := func(progs []string) string {
		for _, pr := range progs {
			if fb, ok := optionalProgs[pr]; ok {
				return fb
			}
		}
		return ""
	}
	types := make([]ebpf.ProgramType, 0, len(progTypes))
	for t := range progTypes {
		types = append(types, t)
	}
	sort.Slice(types, func(i, j int) bool { return types[i] < types[j] })
	for _, t := range types {
		u := progTypes[t]
		err := features.HaveProgramType(t)
		f := Feature{Name: "program type " + t.String(), Since: u.since, Present: true, Required: !u.optional, Needs: u.progs}
		if !f.Required {
			f.Fallback = optional(u.progs)
		}
		f.Present, f.Detail = conclusive(err)
		add(f)
	}
	mapTypes := map[ebpf.MapType][]string{}
	for n, m := range spec.Maps {
		if strings.HasPrefix(n, ".") {
			continue
		}
		mapTypes[m.Type] = append(mapTypes[m.Type], n)
	}
	mts := make([]ebpf.MapType, 0, len(mapTypes))
	for t := range mapTypes {
		mts = append(mts, t)
	}
	sort.Slice(mts, func(i, j int) bool { return mts[i] < mts[j] })
	for _, t := range mts {
		sort.Strings(mapTypes[t])
		f := Feature{Name: "map type " + t.String(), Since: mapSince[t], Required: true, Needs: mapTypes[t]}
		f.Present, f.Detail = conclusive(features.HaveMapType(t))
		add(f)
	}
	// One row per program type: every helper its programs call.
	keys := make([]string, 0, len(helpers))
	for k := range helpers {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, t := range types {
		f := Feature{Name: "helpers of " + t.String() + " programs", Present: true, Required: !progTypes[t].optional,
			Needs: progTypes[t].progs}
		if !f.Required {
			f.Fallback = optional(f.Needs)
		}
		var names, missing, unprobed []string
		for _, k := range keys {
			pt, fn := helperOf[k][0].(ebpf.ProgramType), helperOf[k][1].(asm.BuiltinFunc)
			if pt != t {
				continue
			}
			u := helpers[k]
			hn := helperName(fn)
			names = append(names, hn)
			if newer(u.since, f.Since) {
				f.Since = u.since
			}
			switch err := features.HaveProgramHelper(pt, fn); {
			case err == nil:
			case errors.Is(err, ebpf.ErrNotSupported):
				f.Present = false
				m := hn
				if u.since != "" {
					m += " (Linux " + u.since + ")"
				}
				missing = append(missing, m)
			default:
				// Not conclusive (no helper probe for LSM programs):
				// the program's own load decides.
				unprobed = append(unprobed, hn)
			}
		}
		if len(names) == 0 {
			continue
		}
		f.Name = fmt.Sprintf("%d helpers of %s programs", len(names), t)
		switch {
		case len(missing) > 0:
			f.Detail = "missing " + strings.Join(missing, ", ")
		case len(unprobed) > 0:
			f.Detail = "not probed for this program type: " + strings.Join(unprobed, ", ")
		default:
			f.Detail = strings.Join(names, ", ")
		}
		add(f)
	}
	keys = keys[:0]
	for k := range kfuncs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		u := kfuncs[k]
		f := Feature{Name: "kfunc " + k, Since: u.since, Required: !u.optional, Needs: u.progs}
		if !f.Required {
			f.Fallback = optional(u.progs)
		}
		if kspec != nil {
			var fn *btf.Func
			f.Present = kspec.TypeByName(k, &fn) == nil
		}
		if !f.Present {
			f.Detail = "not in the kernel's BTF"
		}
		add(f)
	}

	// Attach points for the tc programs: tcx links, else clsact.
	tcxErr := probeTCX()
	f = Feature{Name: FeatTCX, Since: "6.6", Present: tcxErr == nil, Fallback: "tc clsact + cls_bpf filters (same order and adoption guarantees)",
		Needs: []string{progIngress, progEgress}}
	if tcxErr != nil {
		f.Detail = tcxErr.Error()
	}
	add(f)
	clsErr := probeClsact()
	f = Feature{Name: FeatClsact, Since: "4.5", Present: clsErr == nil, Required: tcxErr != nil,
		Needs: []string{progIngress + " and " + progEgress + " where tcx is missing"}}
	if clsErr != nil {
		f.Detail = clsErr.Error()
	}
	add(f)

	active, how := LSMActive()
	lsmErr := errors.New("bpf LSM not active")
	if active || !strings.HasPrefix(how, "/") {
		// Unknown (no securityfs): attaching tells.
		lsmErr = probeLSMAttach()
	}
	if !active && lsmErr == nil {
		active, how = true, "an LSM program attached ("+how+")"
	}
	f = Feature{Name: FeatLSMActive, Since: "5.7", Present: active, Fallback: optionalProgs[progUnixStream],
		Needs: []string{progUnixStream, progUnixDgram}, Detail: how}
	add(f)
	f = Feature{Name: FeatLSMAttach, Since: "5.7", Present: lsmErr == nil, Fallback: optionalProgs[progUnixStream],
		Needs: []string{progUnixStream, progUnixDgram}}
	if lsmErr != nil {
		f.Detail = lsmErr.Error()
	}
	add(f)
	return p, nil
}

func helperName(fn asm.BuiltinFunc) string {
	s := fn.String() // "FnSkLookupTcp"
	s = strings.TrimPrefix(s, "Fn")
	var b strings.Builder
	b.WriteString("bpf")
	for _, r := range s {
		if r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
			r += 'a' - 'A'
		}
		b.WriteRune(r)
	}
	return b.String()
}

func kernelRelease() string {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return "unknown"
	}
	return unix.ByteSliceToString(u.Release[:])
}

func noopProgram(t ebpf.ProgramType, at ebpf.AttachType, to string) (*ebpf.Program, error) {
	return ebpf.NewProgramWithOptions(&ebpf.ProgramSpec{
		Type: t, AttachType: at, AttachTo: to, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
	}, ebpf.ProgramOptions{LogDisabled: true})
}

// probeTCX: a tcx link to a device that cannot exist fails with ENODEV
// where tcx exists, and the library reports ErrNotSupported otherwise.
func probeTCX() error {
	prog, err := noopProgram(ebpf.SchedCLS, ebpf.AttachNone, "")
	if err != nil {
		return err
	}
	defer prog.Close()
	l, err := link.AttachTCX(link.TCXOptions{Interface: 0x7fffffff, Program: prog, Attach: ebpf.AttachTCXIngress})
	if err == nil {
		l.Close()
		return nil
	}
	if errors.Is(err, ebpf.ErrNotSupported) {
		return errors.New("not supported (Linux < 6.6)")
	}
	if errors.Is(err, unix.ENODEV) {
		return nil
	}
	return err
}

// probeLSMAttach attaches a no-op (always "allow") program to the
// unix_may_send hook and detaches it: kernels without BPF trampolines (no
// function tracer, e.g. this project's development machines) refuse with
// EPERM although bpf is in the LSM list.
func probeLSMAttach() error {
	prog, err := noopProgram(ebpf.LSM, ebpf.AttachLSMMac, "unix_may_send")
	if err != nil {
		return fmt.Errorf("load: %w", err)
	}
	defer prog.Close()
	l, err := link.AttachLSM(link.LSMOptions{Program: prog})
	if err != nil {
		return fmt.Errorf("attach: %w", err)
	}
	return l.Close()
}

// ChooseTC decides between tcx links and clsact filters for the tc
// programs, from the configuration (tc_attach) and the probe.
func ChooseTC(mode string, p *Probe) (useTC bool, why string, err error) {
	tcx, cls := p.Has(FeatTCX), p.Has(FeatClsact)
	switch mode {
	case "tcx":
		if !tcx {
			return false, "", fmt.Errorf("tc_attach = \"tcx\" but this kernel (Linux %s) has no tcx links (Linux 6.6); use \"auto\" or \"tc\"; nothing was changed", p.Kernel)
		}
		return false, "tc_attach = tcx", nil
	case "tc":
		if !cls {
			return false, "", fmt.Errorf("tc_attach = \"tc\" but clsact/cls_bpf is unavailable: %s; nothing was changed", FeatureDetail(p, FeatClsact))
		}
		return true, "tc_attach = tc", nil
	}
	if tcx {
		return false, "tcx links available (Linux >= 6.6)", nil
	}
	return true, "no tcx links on this kernel (Linux < 6.6): clsact + cls_bpf", nil
}

func AttachName(tc bool) string {
	if tc {
		return "tc"
	}
	return "tcx"
}

func FeatureDetail(p *Probe, name string) string {
	for _, f := range p.Features {
		if f.Name == name {
			return f.Detail
		}
	}
	return ""
}

// newer reports whether version a is later than b ("" is oldest).
func newer(a, b string) bool {
	if a == "" {
		return false
	}
	if b == "" {
		return true
	}
	pa, pb := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(pa) && i < len(pb); i++ {
		x, _ := strconv.Atoi(pa[i])
		y, _ := strconv.Atoi(pb[i])
		if x != y {
			return x > y
		}
	}
	return len(pa) > len(pb)
}

// conclusive reads a features probe: only ErrNotSupported means absent.
// Anything else (e.g. EPERM loading a tracing probe program on a kernel
// without trampolines, where iterator programs still load) leaves the
// decision to the program's own load, which names its error.
func conclusive(err error) (present bool, detail string) {
	switch {
	case err == nil:
		return true, ""
	case errors.Is(err, ebpf.ErrNotSupported):
		return false, err.Error()
	}
	return true, "not probed: " + err.Error()
}
