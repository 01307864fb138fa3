// Package uvnconfig is the [uvn] section of the configuration: its types,
// defaults and checks, apart from the data plane (package uvn) so that the
// configuration does not import a data plane.
package uvnconfig

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// Config is the [uvn] table: the per-user VRF + VXLAN data plane
// (reference 000). Keys:
//
//	enable        = false            # `palisade uvn pam` / SPANK are no-ops unless true
//	exempt_users  = ["munge"]        # accounts that stay in the default VRF (names or uids);
//	                                 # root and slurm.conf's SlurmUser/SlurmdUser always do
//	slurm_conf    = "/etc/slurm/slurm.conf"  # read for SlurmUser, SlurmdUser, SrunPortRange
//	srun_ports    = "61000-62999"    # default: slurm.conf's SrunPortRange (Slurm's callbacks to srun)
//	min_uid       = 1000             # lowest uid with a VRF (table id = uid); other accounts below
//	                                 # it are refused unless exempt — never guessed "system"
//	uid_max       = 16777215         # highest uid served; above 2^24-1 each underlay needs a port block
//	nat_pool      = "100.64.0.0/10"  # per-user CGNAT addresses (SNAT off-subnet)
//	state_dir     = "/run/palisade/uvn"
//	uplinks       = []               # NICs to SNAT out of; default: every non-uvn device of a main-table route
//	vxlan_ttl     = 5
//	src_port_min  = 600              # kernel VXLAN source ports: privileged, so no user socket can use them
//	src_port_max  = 999
//	underlay_ports = ["1-1023", "6817-6819"]  # to cluster nodes: over the underlay with SNAT
//	                                 # (system services and Slurm reached on any node, even one
//	                                 # where the user has no VXLAN yet); other ports: overlay only
//	[[uvn.underlay]]
//	prefixes = ["198.18.0.0/24", "2001:2::/64"]  # first prefix: tunnel endpoint; all: addresses mirrored
//	port     = 4789                  # VXLAN UDP port of this underlay (unique per underlay)
//	group    = "239.192.0.0/16"      # multicast: one group per uid inside this prefix; omit for unicast
//	peers    = ["198.18.0.2"]        # unicast peers (default: [cluster] nodes inside prefixes[0])
type Config struct {
	Enable bool `toml:"enable"`
	// ExemptUsers stay in the default VRF (system accounts, service
	// accounts); root and Slurm's daemon accounts are always exempt.
	ExemptUsers []policy.Principal `toml:"exempt_users"`
	// SlurmConf is read for SlurmUser, SlurmdUser and SrunPortRange.
	SlurmConf string `toml:"slurm_conf"`
	// SrunPorts overrides slurm.conf's SrunPortRange.
	SrunPorts  policy.PortSpec `toml:"srun_ports"`
	MinUID     int64           `toml:"min_uid"`
	UIDMax     int64           `toml:"uid_max"`
	NATPool    string          `toml:"nat_pool"`
	StateDir   string          `toml:"state_dir"`
	Uplinks    []string        `toml:"uplinks"`
	VXLANTTL   int64           `toml:"vxlan_ttl"`
	SrcPortMin int64           `toml:"src_port_min"`
	SrcPortMax int64           `toml:"src_port_max"`
	Underlays  []Underlay      `toml:"underlay"`
	// UnderlayPorts are TCP/UDP destination ports that a user's VRF reaches
	// on cluster nodes through the underlay (SNAT to the node's address)
	// instead of the overlay.
	UnderlayPorts []policy.PortSpec `toml:"underlay_ports"`
	// UnderlayRanges is UnderlayPorts parsed.
	UnderlayRanges []policy.PortRange `toml:"-"`

	// Parsed by Validate.
	NATPrefix netip.Prefix `toml:"-"`
	// SrunRange is SrunPorts parsed (zero: take slurm.conf's).
	SrunRange policy.PortRange `toml:"-"`
}

// Underlay is one [[uvn.underlay]] entry: an underlay network that gets a
// VXLAN per user.
type Underlay struct {
	Prefixes []string `toml:"prefixes"`
	Port     int64    `toml:"port"`
	Group    string   `toml:"group"`
	Peers    []string `toml:"peers"`

	// Parsed by Validate.
	Nets      []netip.Prefix `toml:"-"`
	GroupNet  netip.Prefix   `toml:"-"` // invalid: unicast
	PeerAddrs []netip.Addr   `toml:"-"`
}

// UVN limits that keep names and ports well-formed.
const (
	// MaxUnderlays bounds the underlays: the VXLAN name carries the
	// underlay index as one base-36 character ("pal<i>x<uid>" ≤ 15 bytes).
	MaxUnderlays = 36
	// VNIBits is the VXLAN VNI width.
	VNIBits = 24
	// MaxPortRanges and MaxNets4 are the session programs' limits
	// (enum uvn_limit in bpf/vrf.c): package uvn fails to compile unless
	// they equal the generated ones.
	MaxPortRanges = 8
	MaxNets4      = 64
)

// SetDefaults fills in defaults before the file's values are decoded.
func (u *Config) SetDefaults() {
	u.MinUID = 1000
	u.SlurmConf = "/etc/slurm/slurm.conf"
	u.UIDMax = 1<<VNIBits - 1
	u.NATPool = "100.64.0.0/10"
	u.StateDir = "/run/palisade/uvn"
	u.VXLANTTL = 5
	u.SrcPortMin = 600
	u.SrcPortMax = 999
	u.UnderlayPorts = []policy.PortSpec{"1-1023", "6817-6819"}
}

// PortSpan is how many consecutive UDP ports each underlay uses: one per
// 2^24 uids (uid >> 24 selects the port inside the block).
func (u *Config) PortSpan() int64 { return u.UIDMax>>VNIBits + 1 }

// Validate checks the table after decoding and fills the parsed fields.
func (u *Config) Validate() error {
	var errs []error
	bad := func(key, value, format string, args ...any) {
		errs = append(errs, &policy.KeyError{Key: key, Value: value, Err: fmt.Errorf(format, args...)})
	}
	if u.MinUID < 256 || u.MinUID > 1<<32-2 {
		// Table ids 253-255 are the kernel's default/main/local tables; the
		// VRF table id is the uid itself, so uids below 256 are never served.
		bad("min_uid", "", "%d out of range (256-4294967294): the VRF table id is the uid and must not hit the kernel's tables 253-255", u.MinUID)
	}
	if u.UIDMax < u.MinUID || u.UIDMax > 1<<32-2 {
		bad("uid_max", "", "%d out of range (min_uid-4294967294)", u.UIDMax)
	}
	if p, err := netip.ParsePrefix(u.NATPool); err != nil || !p.Addr().Is4() || p.Bits() > 30 {
		bad("nat_pool", "", "%q: want an IPv4 prefix of at least /30 (e.g. 100.64.0.0/10)", u.NATPool)
	} else {
		u.NATPrefix = p.Masked()
	}
	if u.StateDir == "" || !filepath.IsAbs(u.StateDir) {
		bad("state_dir", "", "%q: want an absolute path", u.StateDir)
	}
	for _, n := range u.Uplinks {
		if n == "" || len(n) > 15 {
			bad("uplinks", n, "%q is not an interface name", n)
		}
	}
	if u.VXLANTTL < 1 || u.VXLANTTL > 255 {
		bad("vxlan_ttl", "", "%d out of range (1-255)", u.VXLANTTL)
	}
	if u.SrcPortMin < 1 || u.SrcPortMin > 1023 {
		bad("src_port_min", "", "%d: must be a privileged port (1-1023) so that no user socket can forge VXLAN traffic", u.SrcPortMin)
	}
	if u.SrcPortMax < u.SrcPortMin || u.SrcPortMax > 1023 {
		bad("src_port_max", "", "%d: must be in src_port_min-1023", u.SrcPortMax)
	}
	u.UnderlayRanges = nil
	for _, ps := range u.UnderlayPorts {
		r, err := policy.ParsePortRange(string(ps))
		if err != nil {
			bad("underlay_ports", string(ps), "%v", err)
			continue
		}
		u.UnderlayRanges = append(u.UnderlayRanges, r)
	}
	u.SrunRange = policy.PortRange{}
	if u.SrunPorts != "" {
		r, err := policy.ParsePortRange(string(u.SrunPorts))
		switch {
		case err != nil:
			bad("srun_ports", string(u.SrunPorts), "%v", err)
		case r.First < 1024:
			bad("srun_ports", string(u.SrunPorts), "%s: srun listens as the user, on unprivileged ports (1024-65535)", r)
		default:
			u.SrunRange = r
		}
	}
	if err := CheckSrunRange(u.SrunRange, u.UnderlayRanges); err != nil {
		bad("srun_ports", string(u.SrunPorts), "%v", err)
	}
	if u.SlurmConf != "" && !filepath.IsAbs(u.SlurmConf) {
		bad("slurm_conf", u.SlurmConf, "%q: want an absolute path", u.SlurmConf)
	}
	for _, p := range u.ExemptUsers {
		if p == "" {
			bad("exempt_users", "", "empty user name")
		}
	}
	// The session programs (bpf/vrf.c) hold this many ranges and prefixes.
	if len(u.UnderlayRanges) > MaxPortRanges {
		bad("underlay_ports", "", "at most %d ranges", MaxPortRanges)
	}
	if len(u.Underlays) > MaxUnderlays {
		bad("underlay", "", "%d underlays; at most %d", len(u.Underlays), MaxUnderlays)
	}
	if u.Enable && len(u.Underlays) == 0 {
		bad("underlay", "", "uvn is enabled but no [[uvn.underlay]] is configured")
	}
	span := u.PortSpan()
	type used struct {
		lo, hi int64
		i      int
	}
	var ports []used
	seenNet := map[netip.Prefix]int{}
	for i := range u.Underlays {
		ul := &u.Underlays[i]
		key := fmt.Sprintf("underlay[%d]", i)
		ul.Nets, ul.PeerAddrs, ul.GroupNet = nil, nil, netip.Prefix{}
		if len(ul.Prefixes) == 0 {
			bad(key+".prefixes", "", "underlay %d has no prefixes", i)
		}
		for _, s := range ul.Prefixes {
			p, err := netip.ParsePrefix(s)
			if err != nil || p.Addr().Is4In6() {
				bad(key+".prefixes", s, "%q is not a prefix", s)
				continue
			}
			p = p.Masked()
			if j, dup := seenNet[p]; dup {
				bad(key+".prefixes", s, "%s is already in underlay %d", p, j)
				continue
			}
			seenNet[p] = i
			ul.Nets = append(ul.Nets, p)
		}
		if ul.Port < 1 || ul.Port+span-1 > 65535 {
			bad(key+".port", "", "%d out of range (1-%d)", ul.Port, 65536-span)
		} else {
			for _, o := range ports {
				if ul.Port <= o.hi && ul.Port+span-1 >= o.lo {
					bad(key+".port", "", "ports %d-%d overlap underlay %d's %d-%d (each underlay needs its own port; uid_max %d needs %d per underlay)",
						ul.Port, ul.Port+span-1, o.i, o.lo, o.hi, u.UIDMax, span)
				}
			}
			if ul.Port <= u.SrcPortMax && ul.Port+span-1 >= u.SrcPortMin {
				bad(key+".port", "", "%d overlaps the VXLAN source ports %d-%d", ul.Port, u.SrcPortMin, u.SrcPortMax)
			}
			ports = append(ports, used{ul.Port, ul.Port + span - 1, i})
		}
		if ul.Group != "" {
			g, err := netip.ParsePrefix(ul.Group)
			if err != nil {
				if a, aerr := netip.ParseAddr(ul.Group); aerr == nil {
					g, err = netip.PrefixFrom(a, a.BitLen()), nil
				}
			}
			switch {
			case err != nil:
				bad(key+".group", "", "%q is not a multicast address or prefix", ul.Group)
			case !g.Addr().IsMulticast():
				bad(key+".group", "", "%s is not multicast", g)
			case len(ul.Nets) > 0 && g.Addr().Is4() != ul.Nets[0].Addr().Is4():
				bad(key+".group", "", "%s is not of the tunnel family (first prefix %s)", g, ul.Nets[0])
			default:
				ul.GroupNet = g.Masked()
			}
			if len(ul.Peers) > 0 {
				bad(key+".peers", "", "peers are for unicast underlays; remove them or the group")
			}
		}
		for _, s := range ul.Peers {
			a, err := netip.ParseAddr(s)
			if err != nil || a.Is4In6() {
				bad(key+".peers", s, "%q is not an address", s)
				continue
			}
			if len(ul.Nets) > 0 && !ul.Nets[0].Contains(a) {
				bad(key+".peers", s, "%s is not in the tunnel prefix %s", a, ul.Nets[0])
				continue
			}
			ul.PeerAddrs = append(ul.PeerAddrs, a)
		}
	}
	if n := len(u.Nets4()); n > MaxNets4 {
		bad("underlay", "", "%d IPv4 prefixes in all; at most %d", n, MaxNets4)
	}
	return errors.Join(errs...)
}

// Nets4 lists the IPv4 prefixes of every underlay (parsed by Validate).
func (u *Config) Nets4() []netip.Prefix {
	var nets []netip.Prefix
	for _, ul := range u.Underlays {
		for _, n := range ul.Nets {
			if n.Addr().Is4() {
				nets = append(nets, n)
			}
		}
	}
	return nets
}

// MaxSrunPorts is the widest srun range: every port of the range may take
// three entries of the claim map (bpf/srun.c pal_srun_ports: its claim, the
// claiming socket's, a lingering claim). TestSrunPortsMap checks it against
// the map's generated spec.
const MaxSrunPorts = 32768

// CheckSrunRange rejects an srun port range that overlaps underlay_ports:
// another user's traffic to those ports leaves its VRF through the node's
// address, so it would reach the range's listeners like Slurm's daemons do.
// It also rejects a range wider than MaxSrunPorts: it could fill the claim
// map, and srun's binds past that point would be refused.
func CheckSrunRange(srun policy.PortRange, underlay []policy.PortRange) error {
	if srun == (policy.PortRange{}) {
		return nil
	}
	if n := int(srun.Last) - int(srun.First) + 1; n > MaxSrunPorts {
		return fmt.Errorf("srun ports %s: %d ports, at most %d (each port may take three entries of a %d-entry claim map)", srun, n, MaxSrunPorts, 3*MaxSrunPorts)
	}
	for _, r := range underlay {
		if r.Overlaps(srun) {
			return fmt.Errorf("srun ports %s overlap underlay_ports %s: other users' traffic to those ports leaves their VRF from the node's address and would reach srun's listeners", srun, r)
		}
	}
	return nil
}
