package kernel

import (
	"fmt"
	"time"

	"github.com/palisade-hpc/palisade/internal/policy"
)

// WriteGrants makes the kernel's grants map hold exactly gs (at most
// policy.GrantsPerPort per owner and port): changed entries written, then
// stale ones deleted.
func (d *Dataplane) WriteGrants(gs []policy.Grant) error {
	want := map[uwbpfUwGrantKey]*uwbpfUwGrants{}
	fill := map[uwbpfUwGrantKey]int{}
	for _, g := range gs {
		k := uwbpfUwGrantKey{Luid: g.Owner, Port: uint32(g.Port)}
		v := want[k]
		if v == nil {
			v = &uwbpfUwGrants{}
			want[k] = v
		}
		i := fill[k]
		if i >= len(v.S) {
			return fmt.Errorf("more than %d grants on port %d of uid %d", len(v.S), g.Port, g.Owner)
		}
		fill[k] = i + 1
		v.S[i].ExpiresNs = g.Expires.UnixNano()
		v.S[i].Id = g.Grantee
		if g.Group {
			v.S[i].Group = 1
		}
	}
	vals := make(map[uwbpfUwGrantKey]uwbpfUwGrants, len(want))
	for k, v := range want {
		vals[k] = *v
	}
	return syncMap(d.Map("grants"), vals)
}

// ReadGrants returns the grants in the kernel's map.
func (d *Dataplane) ReadGrants() ([]policy.Grant, error) {
	var out []policy.Grant
	var k uwbpfUwGrantKey
	var v uwbpfUwGrants
	it := d.Map("grants").Iterate()
	for it.Next(&k, &v) {
		for _, s := range v.S {
			if s.ExpiresNs == 0 {
				continue
			}
			out = append(out, policy.Grant{Owner: k.Luid, Port: uint16(k.Port), Grantee: s.Id, Group: s.Group != 0,
				Expires: time.Unix(0, s.ExpiresNs)})
		}
	}
	return out, it.Err()
}
