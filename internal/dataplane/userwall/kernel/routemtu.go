package kernel

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/palisade-hpc/palisade/internal/sys/nldump"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The stamp's room: an IPv4 option of 20 bytes, an IPv6 destination-options
// header of 24 (bpf/userwall.c).
const (
	StampRoom4 = 20
	StampRoom6 = 24
)

// maxStampedFrame bounds the frame a stamp can be added to: the kernel grows
// a packet that is not GSO only up to SKB_MAX_ALLOC (16 KiB less
// skb_shared_info: 16,064 bytes on x86-64 with 17 fragments, less with more
// MAX_SKB_FRAGS), so a datagram larger than that cannot get one. 16,000
// leaves room for a larger skb_shared_info.
const maxStampedFrame = 16000

// StampMTU is the MTU the agent gives the routes to stamped destinations on
// a device of MTU dev with an L2 header of l2 bytes: the stack then leaves
// the stamp's room in every packet it builds (fragments, UDP GSO segments,
// a Fast Open SYN's data), and a datagram that may not be fragmented gets
// EMSGSIZE at once instead of being lost. Fragments are sized in 8-byte
// units, hence the rounding where the cap applies.
func StampMTU(dev, l2 int, v6 bool) int {
	room := StampRoom4
	if v6 {
		room = StampRoom6
	}
	m := dev - room
	if limit := (maxStampedFrame - l2 - room) &^ 7; m > limit {
		m = limit
	}
	return m
}

// linkLocal4 and linkLocal6 are stamped like the cluster's subnets.
var (
	linkLocal4 = netip.MustParsePrefix("169.254.0.0/16")
	linkLocal6 = netip.MustParsePrefix("fe80::/10")
)

// stampedRoute: does a route to dst lead only to destinations that are
// stamped (inside a cluster subnet, or link-local)?
func stampedRoute(dst netip.Prefix, cluster []netip.Prefix) bool {
	for _, c := range append([]netip.Prefix{linkLocal4, linkLocal6}, cluster...) {
		if c.Addr().Is4() == dst.Addr().Is4() && c.Bits() <= dst.Bits() && c.Contains(dst.Addr()) {
			return true
		}
	}
	return false
}

// RouteChange is one route whose MTU SyncRouteMTU set (or would restore).
type RouteChange struct {
	Dst      netip.Prefix
	Dev      string
	From, To int
}

// SyncRouteMTU gives every main-table route to a stamped destination through
// one of the managed devices (lo excepted: it carries tokens, not stamps,
// where a stamp does not fit) the MTU StampMTU says, unless the route already
// has one at most that. restore undoes it (uninstall): routes at exactly the
// MTU the agent gives lose their MTU. l2 maps managed ifindexes to their L2
// header length.
func SyncRouteMTU(cluster []netip.Prefix, l2 map[int]int, restore bool) ([]RouteChange, error) {
	var changed []RouteChange
	var errs []error
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		rs, err := nldump.Retry(func() ([]netlink.Route, error) {
			return netlink.RouteListFiltered(fam, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
		})
		if err != nil {
			errs = append(errs, err)
			continue
		}
		// A replace names a route by destination, table and metric, not
		// device (IPv6: the first of the same metric is replaced): routes
		// that share those with another (fe80::/64 on every device) are
		// left alone rather than have one device's route taken away.
		type rkey struct {
			dst  string
			prio int
		}
		same := map[rkey]int{}
		for _, r := range rs {
			if r.Dst != nil {
				same[rkey{r.Dst.String(), r.Priority}]++
			}
		}
		for _, r := range rs {
			hl, managed := l2[r.LinkIndex]
			if r.Dst != nil && same[rkey{r.Dst.String(), r.Priority}] > 1 {
				continue
			}
			if r.Dst == nil || !managed || r.LinkIndex == 1 || len(r.MultiPath) > 0 {
				continue
			}
			a, ok := netip.AddrFromSlice(r.Dst.IP)
			if !ok {
				continue
			}
			ones, _ := r.Dst.Mask.Size()
			dst := netip.PrefixFrom(a.Unmap(), ones)
			if !stampedRoute(dst, cluster) {
				continue
			}
			link, err := netlink.LinkByIndex(r.LinkIndex)
			if err != nil {
				continue // gone since the dump
			}
			want := StampMTU(link.Attrs().MTU, hl, fam == netlink.FAMILY_V6)
			to := want
			switch {
			case restore && r.MTU == want:
				to = 0
			case restore, r.MTU != 0 && r.MTU <= want:
				continue
			}
			ch := RouteChange{Dst: dst, Dev: link.Attrs().Name, From: r.MTU, To: to}
			nr := r
			nr.MTU = to
			if err := netlink.RouteReplace(&nr); err != nil {
				errs = append(errs, fmt.Errorf("route %s dev %s: mtu %d: %w", dst, ch.Dev, to, err))
				continue
			}
			changed = append(changed, ch)
		}
	}
	return changed, errors.Join(errs...)
}

// L2HeaderLen is the length of the link-layer header the tc programs see.
func L2HeaderLen(encap string) (int, bool) {
	switch encap {
	case "ether", "loopback":
		return 14, true
	case "none": // tun, wireguard: the IP header comes first
		return 0, true
	case "infiniband": // IPoIB: a 4-byte header (protocol, reserved)
		return 4, true
	}
	return 0, false
}
